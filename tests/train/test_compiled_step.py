"""Step variants take the eager step: ``model.compile`` (each decoder layer torch.compile'd, CUDA-graphed in
reduce-overhead mode) and ``model.grad_accum_fusion`` (weight-gradient GEMMs accumulating into the fp32 main grads):
same loss and gradients, to fp32 rounding on CPU (inductor) and bf16 rounding on a GPU
(``tests/workers/compiled_step_worker.py``)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, worker_report

WORKER = REPO / "tests" / "workers" / "compiled_step_worker.py"
TINY_WEIGHTS = 4 * 4  # the tiny Qwen2's linear weights: qkv, proj, fc1, fc2 in each of its 4 layers


def _differences(tmp_path, precision: str, *variant: str, cpu: bool) -> dict[str, float]:
    return worker_report(WORKER, tmp_path, "COMPILED", precision, *variant, cpu=cpu)


@pytest.mark.slow
def test_compiled_layers_take_the_eager_step_on_cpu(tmp_path):
    diff = _differences(tmp_path, "fp32", "compile=true", cpu=True)
    assert diff["loss"] < 1e-5 and diff["grads"] < 1e-4, diff  # measured 3.7e-7 and 7.3e-7
    assert diff["fused"] == 0, diff  # off by default on the local spec


def test_fused_weight_gradients_take_the_eager_step_on_cpu(tmp_path):
    diff = _differences(tmp_path, "fp32", "grad_accum_fusion=true", cpu=True)
    assert diff["fused"] == TINY_WEIGHTS, diff
    assert diff["fused_adam"] == 1, diff  # megatron's torch AdamW switched to torch's fused kernel
    assert diff["loss"] < 1e-6 and diff["grads"] < 1e-5, diff


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [("compile=true", "grad_accum_fusion=false"),
                                     ("compile=true", "compile_mode=reduce-overhead", "grad_accum_fusion=false"),
                                     ("grad_accum_fusion=true",),
                                     ("compile=true", "compile_mode=reduce-overhead")])
def test_step_variants_take_the_eager_step_on_gpu(tmp_path, variant):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    diff = _differences(tmp_path, "bf16", *variant, cpu=False)  # reduce-overhead: replayed as CUDA graphs
    assert diff["loss"] < 1e-2 and diff["grads"] < 5e-2, diff
    assert diff["fused"] == (TINY_WEIGHTS if "grad_accum_fusion=true" in variant else 0), diff  # local spec: off
