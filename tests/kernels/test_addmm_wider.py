"""The Triton path's weight-gradient accumulation (``kernels._triton_ops._addmm_wider``): ``acc = beta * acc + a @ b``
for 16-bit operands into a float32 accumulator; ``beta = 0`` (a loop's first chunk) never reads the uninitialised
accumulator. On a GPU it is one GEMM accumulating in float32: no 16-bit product rounded per chunk."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.kernels import _triton_ops


def _two_chunks(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(40, 96, generator=gen).to(device, torch.bfloat16) for _ in range(2)]  # dL/dy^T [V, c]
    b = [torch.randn(96, 24, generator=gen).to(device, torch.bfloat16) for _ in range(2)]  # h [c, H]
    acc = torch.full((40, 24), float("nan"), device=device)  # as torch.empty may hold: beta 0 must not read it
    storage = acc.data_ptr()
    expected = torch.zeros(40, 24, dtype=torch.float64, device=device)
    for beta, x, y in zip((0.0, 1.0), a, b):
        _triton_ops._addmm_wider(acc, x, y, beta)
        expected += x.double() @ y.double()
    assert acc.data_ptr() == storage and acc.dtype == torch.float32  # in place
    return acc.double(), expected


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_chunks_accumulate_from_an_uninitialised_accumulator_on_cpu():
    got, expected = _two_chunks("cpu")
    assert not got.isnan().any() and _rel(got, expected) < 1e-2  # a 16-bit product per chunk: bf16's rounding


@pytest.mark.gpu
def test_chunks_accumulate_in_fp32_in_one_gemm_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got, expected = _two_chunks("cuda")
    # fp32 accumulation of the exact bf16 operands: far inside bf16's own rounding (a 16-bit product reads ~2e-3)
    assert not got.isnan().any() and _rel(got, expected) < 1e-5
    assert _triton_ops._WIDER_OUT[0], "fell back to a 16-bit product per chunk (see the warning)"
