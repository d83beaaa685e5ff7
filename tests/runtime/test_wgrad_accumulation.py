"""The torch stand-in for apex's fused weight-gradient kernel (``model.grad_accum_fusion`` without apex or TE):
``main_grad += grad_output^T @ input`` in place, accumulated in fp32 from 16-bit operands on a GPU."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.runtime._local_fallbacks import TorchWgradAccumulation


def _accumulated_twice(device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(96, 48, generator=gen).to(device, dtype) for _ in range(2)]  # [tokens, in]
    grads = [torch.randn(96, 32, generator=gen).to(device, dtype) for _ in range(2)]   # [tokens, out]
    main_grad = torch.randn(32, 48, generator=gen).to(device)                           # fp32, [out, in]
    expected = main_grad.double().clone()
    storage = main_grad.data_ptr()
    for x, g in zip(inputs, grads):  # two micro-batches
        TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, g, main_grad)
        expected += g.double().t() @ x.double()
    assert main_grad.data_ptr() == storage and main_grad.dtype == torch.float32  # in place
    return main_grad.double(), expected


def test_weight_gradients_accumulate_into_the_fp32_main_grad_on_cpu():
    got, expected = _accumulated_twice("cpu", torch.float32)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_bf16_weight_gradients_accumulate_in_fp32_in_one_gemm_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got, expected = _accumulated_twice("cuda", torch.bfloat16)
    # fp32 accumulation of the exact bf16 operands: far inside bf16's own rounding (4e-3)
    assert float((got - expected.cuda()).norm() / expected.norm()) < 1e-5
    assert TorchWgradAccumulation.in_place_fp32_out, "fell back to a separate fp32 product (see the warning)"
