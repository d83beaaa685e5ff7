"""model.precision=bf16 without Transformer Engine: the local-spec policy takes an optimizer step on CPU with bf16
weights, fp32 main weights and grads in megatron's optimizer, and a finite loss (tests/workers/bf16_policy_worker.py
holds the checks)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import REPO, tiny_hf_config, write_json

WORKER = REPO / "tests" / "workers" / "bf16_policy_worker.py"


def test_bf16_policy_step_keeps_fp32_main_weights(tmp_path):
    write_json(tmp_path / "config.json", tiny_hf_config("qwen2", tied=True))  # init=random: the config is enough
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(WORKER), str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert "BF16 STEP" in proc.stdout
