"""``model.compile`` (each decoder layer torch.compile'd) takes the eager step: same loss and gradients, to fp32 rounding on CPU (inductor) and bf16 rounding on a GPU (``tests/workers/compiled_step_worker.py``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO, tiny_hf_config, write_json

WORKER = REPO / "tests" / "workers" / "compiled_step_worker.py"


def _differences(tmp_path, precision: str, cpu: bool) -> dict[str, float]:
    write_json(tmp_path / "config.json", tiny_hf_config("qwen2", tied=True))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path), precision], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    line = re.search(r"^COMPILED (.*)$", proc.stdout, re.M).group(1)
    return {k: float(v) for k, v in (part.split("=") for part in line.split())}


@pytest.mark.slow
def test_compiled_layers_take_the_eager_step_on_cpu(tmp_path):
    diff = _differences(tmp_path, "fp32", cpu=True)
    assert diff["loss"] < 1e-5 and diff["grads"] < 1e-4, diff  # measured 3.7e-7 and 7.3e-7


@pytest.mark.gpu
def test_compiled_layers_take_the_eager_step_on_gpu(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    diff = _differences(tmp_path, "bf16", cpu=False)
    assert diff["loss"] < 1e-2 and diff["grads"] < 5e-2, diff
