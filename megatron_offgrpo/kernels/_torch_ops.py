"""The chunked torch implementation of the two elementwise stages (any device).

Per chunk the driver computes ``y = h_c @ W_shard^T`` [c, V/tp] into a reused buffer; this module then

1. ``local_stats``: copies ``y`` (scaled by ``post_scale``) into the accumulation buffer when the dtypes differ,
   takes the row max and the target logit, and turns the buffer IN PLACE into the shard-local softmax
   ``p_r = softmax(z)`` [c, V/tp] with one fused, cache-blocked kernel (``aten._softmax.out``). The shard's
   log-sum-exp is ``max - log p_r[argmax]`` (``p_r[argmax] = 1 / sum exp(z - max)``, never underflows).
2. ``grads``: uses ``dL/dy = coeff * (onehot - m_r p_r)`` (``m_r`` = mass of the shard, see ``_tp``) WITHOUT
   forming it: ``grad_h = coeff W[t] - (coeff m_r) (p_r @ W)`` and ``grad_W += onehot^T (coeff h)
   - p_r^T ((coeff m_r) h)``; only [c, H] tensors are scaled, so the [c, V/tp] buffer is read by the two
   GEMMs and never rewritten.

Shape notation: c tokens of one chunk, H hidden, V/tp vocabulary rows of this rank's shard.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_offgrpo.kernels._tp import ChunkStats

_ENTROPY_BLOCK_BYTES = 2 << 20  # scratch of the row-blocked entropy, allocated once per call


class TorchOps:
    """Elementwise stages in plain torch ops, with one [c, V/tp] accumulation buffer reused across chunks.

    Args:
        logits_buffer: [c_max, V/tp] buffer the driver writes ``y`` into (the weight's dtype).
        acc_dtype: dtype of the softmax and of the statistics (float32, or float64 for float64 inputs).
    """

    name = "torch"

    def __init__(self, logits_buffer: torch.Tensor, acc_dtype: torch.dtype) -> None:
        self._logits = logits_buffer
        same = logits_buffer.dtype == acc_dtype
        self._acc = logits_buffer if same else torch.empty_like(logits_buffer, dtype=acc_dtype)
        self._probs: Optional[torch.Tensor] = None
        self._scratch: Optional[torch.Tensor] = None

    def local_stats(
        self, y: torch.Tensor, post_scale: float, target: torch.Tensor, in_shard: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Shard statistics of ``z = post_scale * y``; leaves the shard-local softmax in the buffer.

        Args:
            y: [c, V/tp] a view of the logits buffer.
            post_scale: factor applied to ``y`` (1 / temperature when the hidden states were not pre-scaled).
            target: [c] int64 target index inside the shard (any valid index where ``in_shard`` is False).
            in_shard: [c] bool, True = the token's target lies in this rank's vocab shard.
            entropy: also return the entropy of the shard-local softmax.

        Returns:
            ``(lse_r [c], target logit [c] (0 where not in shard), entropy_r [c] or None)``.
        """
        z = self._acc[: y.shape[0]]
        if z.data_ptr() != y.data_ptr():
            z.copy_(y)
        if post_scale != 1.0:
            z.mul_(post_scale)
        row_max, argmax = z.max(dim=1)
        target_logit = torch.where(in_shard, z.gather(1, target.unsqueeze(1)).squeeze(1), 0)
        if entropy:
            p_dot_shifted = self._softmax_keeping_dot(z, row_max)
        else:
            torch.ops.aten._softmax.out(z, 1, False, out=z)  # in place: z -> p_r
        lse_r = row_max - torch.log(z.gather(1, argmax.unsqueeze(1)).squeeze(1))
        self._probs = z
        # H_r = -sum p log p = lse_r - sum p z, since log p = z - lse_r: no logarithm per vocabulary entry (profiled:
        # torch.special.entr cost as much as the chunk's three GEMMs on CPU). Shifted by the row max, the products
        # stay small where p is large: the sum's rounding is below entr's (tests/kernels/test_kernels_api.py).
        return lse_r, target_logit, (lse_r - row_max - p_dot_shifted if entropy else None)

    def _softmax_keeping_dot(self, z: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        """Softmax of ``z`` [c, V/tp] in place, row block by row block through one scratch that keeps the block's
        logits less their row max; returns [c] ``sum_v p_v (z_v - max)``."""
        if self._scratch is None:
            rows = max(1, _ENTROPY_BLOCK_BYTES // (z.shape[1] * z.element_size()))
            self._scratch = torch.empty(min(rows, self._acc.shape[0]), z.shape[1], dtype=z.dtype, device=z.device)
        out = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
        step = self._scratch.shape[0]
        for i in range(0, z.shape[0], step):
            block = z[i : i + step]
            shifted = self._scratch[: block.shape[0]]
            torch.sub(block, row_max[i : i + step].unsqueeze(1), out=shifted)
            torch.ops.aten._softmax.out(block, 1, False, out=block)
            torch.sum(shifted.mul_(block), dim=1, out=out[i : i + step])
        return out

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
        """Accumulates ``dL/dW`` into ``grad_weight`` and returns ``dL/dh_lin`` for the chunk.

        Args:
            weight: [V/tp, H] this rank's output-layer shard.
            h_lin: [c, H] the hidden states the logits GEMM used.
            target: [c] int64 target index inside the shard.
            in_shard: [c] bool, True = the target lies in this shard.
            coeff: [c] ``dL/dlogp`` times the post scale (acc dtype).
            stats: the merged statistics of the chunk.
            grad_weight: [V/tp, H] accumulator (acc dtype), or None when W needs no gradient.
            need_grad_h: whether to compute the hidden-state gradient.
            overwrite: write instead of accumulate into ``grad_weight`` (first chunk: it is uninitialised).

        Returns:
            [c, H] ``dL/dh_lin`` in the acc dtype, or None.
        """
        probs = self._probs
        assert probs is not None, "local_stats must run before grads"
        acc = probs.dtype
        onehot_coeff = (coeff * in_shard).unsqueeze(1)  # [c, 1]
        prob_coeff = (coeff * stats.local_mass).unsqueeze(1)  # [c, 1]
        grad_h = None
        if need_grad_h:
            p_w = probs if probs.dtype == weight.dtype else self._logits[: probs.shape[0]].copy_(probs)
            grad_h = torch.mm(p_w, weight).to(acc).mul_(-prob_coeff)
            grad_h.addcmul_(weight.index_select(0, target).to(acc), onehot_coeff)
        if grad_weight is not None:
            h_acc = h_lin.to(acc)
            grad_weight.addmm_(probs.t(), h_acc * -prob_coeff, beta=0.0 if overwrite else 1.0)
            grad_weight.index_add_(0, target, h_acc * onehot_coeff)
        self._probs = None
        return grad_h

