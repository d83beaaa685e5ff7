"""megatron-core's own fallbacks for apex's fused multi-tensor kernels, replaced by torch's ``_foreach`` ops.

Without apex and Transformer Engine (every CPU run; a GPU image without TE, such as the lent device image),
megatron's optimizer and gradient clipping use ``megatron.core.utils.local_multi_tensor_l2_norm`` and
``local_multi_tensor_scale``. The first reads every parameter's gradient norm to the host
(``torch.norm(torch.tensor(list_of_norms))``): measured on an H200, 170 of the 228 host synchronisations of one
Qwen2.5-0.5B training step. The second launches one multiply and one copy per parameter. The replacements compute
the same values with one ``_foreach`` call each and never read the device; they are installed only where megatron
chose its local fallback (apex's or TE's kernels are left alone).

One more name is missing without TE: the MoE router's gating GEMM calls ``moe_utils.te_general_gemm``, which 0.16.1
binds only when TE imports ("NameError: name 'te_general_gemm' is not defined", seen on CPU and on an H200 without
TE); None selects its torch path.

And apex's ``fused_weight_gradient_mlp_cuda``, which megatron's parallel linears need for
``gradient_accumulation_fusion`` (``model.grad_accum_fusion``): without it each linear's backward returns a bf16 weight
gradient that megatron's DDP hook then adds to the fp32 ``main_grad``, one more kernel per weight and micro-batch
(21 ms of a Qwen2.5-0.5B step's 262 ms of kernels on an H200). ``TorchWgradAccumulation`` does apex's job with one
GEMM that accumulates into ``main_grad`` in fp32 (``torch.addmm`` with an fp32 output on CUDA); measured, it saves
little of that (docs/benchmarks.md, "GPU validation"), so ``model.grad_accum_fusion`` leaves it off by default.
"""

from __future__ import annotations

import warnings

import torch

_INSTALLED: list[str] = []


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: ``(total norm [1] float32, None)`` over every tensor given."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract: ``dst = src * scale`` for each pair (dst's dtype kept)."""
    sources, targets = tensor_lists
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, scale)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


class TorchWgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` contract: ``main_grad += grad_output^T @ input`` in place, with
    ``input`` [tokens, in] and ``grad_output`` [tokens, out] of the params' dtype."""

    in_place_fp32_out = True  # cleared (with a warning) if this torch's CUDA addmm refuses out_dtype in place

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        if not (main_grad.is_cuda and total_input.dtype in (torch.bfloat16, torch.float16)):
            main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))
            return
        if TorchWgradAccumulation.in_place_fp32_out:
            try:
                # one cuBLAS GEMM: 16-bit operands, fp32 accumulation, beta = 1 onto main_grad (no 16-bit product)
                torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)
                return
            except RuntimeError as exc:
                TorchWgradAccumulation.in_place_fp32_out = False
                warnings.warn(f"torch.addmm(out_dtype=float32, out=main_grad) failed ({str(exc).splitlines()[0]}): "
                              "the weight-gradient GEMM writes an fp32 product that is then added", stacklevel=2)
        main_grad.add_(torch.mm(grad_output.t(), total_input, out_dtype=torch.float32))

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def apply_local_fallbacks() -> list[str]:
    """Install the replacements where megatron uses its local fallbacks; returns what was replaced (idempotent)."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer.moe import moe_utils

    if _INSTALLED:
        return list(_INSTALLED)
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _INSTALLED.append("megatron.core.transformer.moe.moe_utils.te_general_gemm")
    if not layers._grad_accum_fusion_available:
        # only used where a config asks for gradient_accumulation_fusion (model.grad_accum_fusion)
        layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
        layers._grad_accum_fusion_available = True
        _INSTALLED.append("megatron.core.tensor_parallel.layers.fused_weight_gradient_mlp_cuda")
    swaps = ((clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, foreach_l2_norm),
             (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale),
             (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, foreach_scale))
    for module, name, local, replacement in swaps:
        if getattr(module, name, None) is local:
            setattr(module, name, replacement)
            _INSTALLED.append(f"{module.__name__}.{name}")
    return list(_INSTALLED)
