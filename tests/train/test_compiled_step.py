"""``model.compile`` (each decoder layer torch.compile'd) takes the eager step: same loss and gradients, to fp32
rounding on CPU (inductor) and bf16 rounding on a GPU (``tests/workers/compiled_step_worker.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, worker_report

WORKER = REPO / "tests" / "workers" / "compiled_step_worker.py"


def _differences(tmp_path, precision: str, cpu: bool, mode: str = "default") -> dict[str, float]:
    return worker_report(WORKER, tmp_path, "COMPILED", precision, mode, cpu=cpu)


@pytest.mark.slow
def test_compiled_layers_take_the_eager_step_on_cpu(tmp_path):
    diff = _differences(tmp_path, "fp32", cpu=True)
    assert diff["loss"] < 1e-5 and diff["grads"] < 1e-4, diff  # measured 3.7e-7 and 7.3e-7


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_layers_take_the_eager_step_on_gpu(tmp_path, mode):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    diff = _differences(tmp_path, "bf16", cpu=False, mode=mode)  # reduce-overhead: replayed as CUDA graphs
    assert diff["loss"] < 1e-2 and diff["grads"] < 5e-2, diff
