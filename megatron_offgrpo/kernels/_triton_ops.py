"""The Triton implementation of the two elementwise stages (CUDA; CPU only under ``TRITON_INTERPRET=1``).

GEMMs stay in ``torch.mm`` (cuBLAS). Two kernels work on the [c, V/tp] logits buffer in the weight's dtype,
computing in float32:

1. ``_shard_stats_kernel`` (one program per token): one pass over the row with an online max / sum-exp
   (and ``sum e^z z`` for the entropy), plus the target logit: the shard's log-sum-exp, target logit and
   local entropy. The buffer is only read.
2. ``_dlogits_kernel`` (token x vocab-block programs): overwrites the buffer IN PLACE with
   ``dL/dy = coeff * (onehot - exp(s * y - lse))`` using the GLOBAL log-sum-exp, so the two gradient GEMMs read
   it directly.

Interpreter gaps respected (see notes/kernels-and-te.md): no ``tl.dot``, no atomics, no autotune.

Shape notation: c tokens of one chunk, H hidden, V/tp vocabulary rows of this rank's shard.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional

import torch

from megatron_offgrpo.kernels._tp import ChunkStats

try:  # optional dependency: a flag, set once (STYLE.md "optional dependencies become flags")
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton path can run on ``device``, and why not.

    Args:
        device: the device of the inputs.

    Returns:
        ``(usable, reason)``; ``reason`` is empty when usable.
    """
    if not HAVE_TRITON:
        return False, "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (
        f"triton kernels need CUDA tensors, got device {device}; on CPU set TRITON_INTERPRET=1 before importing "
        "triton (tests only), or use impl='torch'"
    )


if HAVE_TRITON:

    @triton.jit
    def _shard_stats_kernel(
        y_ptr, stride, target_ptr, lse_ptr, tgt_logit_ptr, entropy_ptr, post_scale, vocab,
        BLOCK: tl.constexpr, ENTROPY: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = y_ptr + row.to(tl.int64) * stride
        offs = tl.arange(0, BLOCK)
        run_max = tl.zeros([], dtype=tl.float32) - float("inf")
        run_sum = tl.zeros([], dtype=tl.float32)
        run_zsum = tl.zeros([], dtype=tl.float32)  # sum exp(z - run_max) * z, for the entropy
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32) * post_scale
            new_max = tl.maximum(run_max, tl.max(z, axis=0))
            alpha = tl.exp(run_max - new_max)
            e = tl.exp(z - new_max)  # 0 on the masked tail
            run_sum = run_sum * alpha + tl.sum(e, axis=0)
            if ENTROPY:
                run_zsum = run_zsum * alpha + tl.sum(e * tl.where(cols < vocab, z, 0.0), axis=0)
            run_max = new_max
        lse = run_max + tl.log(run_sum)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:
            tl.store(entropy_ptr + row, lse - run_zsum / run_sum)
        target = tl.load(target_ptr + row)  # -1 = not in this shard
        hit = target >= 0
        logit = tl.load(base + tl.maximum(target, 0), mask=hit, other=0.0).to(tl.float32) * post_scale
        tl.store(tgt_logit_ptr + row, tl.where(hit, logit, 0.0))

    @triton.jit
    def _dlogits_kernel(y_ptr, stride, target_ptr, coeff_ptr, lse_ptr, post_scale, vocab, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ptrs = y_ptr + row.to(tl.int64) * stride + cols
        inside = cols < vocab
        z = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * post_scale
        probs = tl.exp(z - tl.load(lse_ptr + row))
        onehot = (cols == tl.load(target_ptr + row)).to(tl.float32)
        grad = tl.load(coeff_ptr + row) * (onehot - probs)
        tl.store(ptrs, grad.to(y_ptr.dtype.element_ty), mask=inside)


STATS_BLOCK_CAP = 4096
"""Vocab columns per iteration of the stats kernel (the row loop covers V/tp in blocks of this)."""
GRAD_BLOCK_CAP = 2048
"""Vocab columns per program of the dlogits kernel."""


def _block(vocab: int, cap: int) -> int:
    """The next power of two >= ``vocab``, clamped to [16, cap]."""
    return min(cap, max(16, 1 << max(0, (vocab - 1).bit_length())))


class TritonOps:
    """Elementwise stages as Triton kernels on the [c, V/tp] logits buffer (no second buffer).

    Args:
        logits_buffer: [c_max, V/tp] buffer the driver writes ``y`` into (the weight's dtype).
        acc_dtype: dtype of the statistics (float32).
    """

    name = "triton"

    def __init__(self, logits_buffer: torch.Tensor, acc_dtype: torch.dtype) -> None:
        ok, why = triton_usable(logits_buffer.device)
        if not ok:
            raise ValueError(f"impl='triton' cannot run: {why}")
        if acc_dtype != torch.float32:
            raise ValueError(
                f"impl='triton' computes in float32; got inputs needing {acc_dtype}; use impl='torch' for float64"
            )
        self._y: Optional[torch.Tensor] = None
        self._post_scale = 1.0

    def local_stats(
        self, y: torch.Tensor, post_scale: float, target: torch.Tensor, in_shard: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Same contract as ``TorchOps.local_stats``; the buffer is left holding ``y``."""
        rows, vocab = y.shape
        lse = torch.empty(rows, dtype=torch.float32, device=y.device)
        tgt_logit, ent = torch.empty_like(lse), torch.empty_like(lse)
        local_target = torch.where(in_shard, target, -1).contiguous()
        _shard_stats_kernel[(rows,)](
            y, y.stride(0), local_target, lse, tgt_logit, ent, float(post_scale), vocab,
            BLOCK=_block(vocab, STATS_BLOCK_CAP), ENTROPY=entropy, num_warps=8,
        )
        self._y, self._post_scale = y, float(post_scale)
        return lse, tgt_logit, (ent if entropy else None)

    def grads(
        self,
        weight: torch.Tensor,
        h_lin: torch.Tensor,
        target: torch.Tensor,
        in_shard: torch.Tensor,
        coeff: torch.Tensor,
        stats: ChunkStats,
        grad_weight: Optional[torch.Tensor],
        need_grad_h: bool,
        overwrite: bool = False,
    ) -> Optional[torch.Tensor]:
        """Same contract as ``TorchOps.grads``; turns the buffer into ``dL/dy`` in place first."""
        y = self._y
        assert y is not None, "local_stats must run before grads"
        rows, vocab = y.shape
        block = _block(vocab, GRAD_BLOCK_CAP)
        _dlogits_kernel[(rows, triton.cdiv(vocab, block))](
            y, y.stride(0), torch.where(in_shard, target, -1).contiguous(), coeff.float().contiguous(),
            stats.lse.float().contiguous(), self._post_scale, vocab, BLOCK=block, num_warps=4,
        )
        grad_h = torch.mm(y, weight).float() if need_grad_h else None
        if grad_weight is not None:
            beta = 0.0 if overwrite else 1.0
            if y.dtype == grad_weight.dtype:
                grad_weight.addmm_(y.t(), h_lin, beta=beta)
            else:  # 16-bit operands, accumulated in float32 across chunks
                _addmm_wider(grad_weight, y.t(), h_lin, beta)
        self._y = None
        return grad_h


_WIDER_OUT = [True]  # cleared once if this torch's CUDA addmm refuses out_dtype in place (an older torch)


def _addmm_wider(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """``acc = beta * acc + a @ b`` for 16-bit ``a``, ``b`` and a wider ``acc`` (``beta`` 0: acc is not read).

    On CUDA one cuBLAS GEMM accumulates in float32 straight onto ``acc``; otherwise a 16-bit product is written and
    then added. At Qwen's vocabulary (acc [151,936, 896] float32, 544 MB) the product costs, per chunk, its 272 MB
    16-bit write and an add that reads both and writes acc again (about 1.4 GB of traffic, against the 1.1 GB of
    the GEMM reading and writing acc itself), and rounds every chunk's contribution to 16 bits before it is summed.
    The same call as ``runtime``'s weight-gradient fallback (``TorchWgradAccumulation``). On an H100 the fused loss at
    N = 16,384 bf16 took 49.5 ms against 51.8 (docs/benchmarks.md, "GPU validation").
    """
    if acc.is_cuda and _WIDER_OUT[0]:
        try:
            torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
            return
        except RuntimeError as exc:
            _WIDER_OUT[0] = False
            warnings.warn(f"torch.addmm(out_dtype={acc.dtype}, out=...) failed ({str(exc).splitlines()[0]}): the "
                          "fused loss's weight gradient adds a 16-bit product per chunk instead", stacklevel=2)
    product = torch.mm(a, b)
    if beta == 0.0:
        acc.copy_(product)
    else:
        acc.add_(product)
