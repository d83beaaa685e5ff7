"""The chunk loop shared by both implementations: one pass over token chunks, gradients computed eagerly.

Per chunk of c valid tokens (rows of the hidden states):

    y = h_c @ W_shard^T                      [c, V/tp]  GEMM 1, into a buffer reused across chunks
    shard stats -> merged stats (_tp)        lse, target logit (, entropy): logp_c = target - lse   [c]
    loss_parts.token_loss on a leaf copy of logp_c -> autograd gives g_c = d loss / d logp_c (aggregation weights in)
    grad_h_c = dL/dy @ W_shard               [c, H]     GEMM 2
    grad_W  += dL/dy^T @ h_c                 [V/tp, H]  GEMM 3 (float32 accumulator)

so the work is the three GEMMs of an unfused layer, and the extra memory is one [c, V/tp] buffer (two when the
weights are in 16-bit and the torch implementation is used). The temperature scales the small [c, H] hidden
chunk when it is in float32/float64 and the logits otherwise.

Shape notation: N tokens, n valid tokens (loss mask True), c tokens of one chunk, H hidden, V/tp vocabulary rows
of this rank's shard.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist

from megatron_offgrpo.algo import ObjectiveParams, loss_parts, objectives
from megatron_offgrpo.kernels._torch_ops import TorchOps
from megatron_offgrpo.kernels._tp import ChunkStats, all_reduce_sum, group_size_rank, merge_stats
from megatron_offgrpo.kernels._triton_ops import TritonOps

Ops = Union[TorchOps, TritonOps]


@dataclass(frozen=True)
class Run:
    """How to run the chunk loop (validated by the public functions).

    Attributes:
        hidden: [N, H] hidden states after the final norm.
        weight: [V/tp, H] this rank's output-layer shard.
        group: the TP process group, or None.
        temperature: T > 0; logits are divided by it.
        chunk_size: tokens per chunk (>= 1).
        impl: ``"torch"`` or ``"triton"`` (already resolved from ``"auto"``).
        entropy: also compute the per-token entropy.
        stats_dtype: dtype of the softmax statistics when wider than the default (float64: the log-softmax of the
            logits exact to the logits' own rounding, torch path only), else None.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    group: Optional[dist.ProcessGroup]
    temperature: float
    chunk_size: int
    impl: str
    entropy: bool
    stats_dtype: Optional[torch.dtype] = None

    @property
    def acc_dtype(self) -> torch.dtype:
        """Dtype of the softmax statistics, the loss and the weight-gradient accumulator (>= float32)."""
        return self.stats_dtype or torch.promote_types(self.weight.dtype, torch.float32)

    @property
    def scales(self) -> tuple[float, float]:
        """``(pre, post)``: 1/T applied to the hidden chunk (full-precision inputs) or to the logits."""
        inv = 1.0 / self.temperature
        return (inv, 1.0) if self.hidden.dtype == self.acc_dtype else (1.0, inv)


@dataclass(frozen=True)
class TokenBatch:
    """Per-token inputs of the n valid tokens, compacted: entry k belongs to hidden row ``rows[k]``.

    Attributes:
        rows: [n] int64 row of each valid token in ``hidden``, or None when all N tokens are valid.
        targets: [n] int64 target token ids (global vocabulary ids).
        behavior_logp: [n] behavior-policy log-probs.
        advantages: [n] advantages.
        weights: [n] aggregation weight of each token (d loss / d per-token loss).
        ref_logp: [n] reference log-probs, or None.
        tis_weights: [n] truncated-IS weights, or None.
        seq_ids: [n] sequence id of each token, for a sequence-level objective (gspo), else None.
        seq_log_ratio: [n] ``algo.objectives.sequence_log_ratio`` of each token's sequence, filled by the first pass.
    """

    rows: Optional[torch.Tensor]
    targets: torch.Tensor
    behavior_logp: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    tis_weights: Optional[torch.Tensor] = None
    seq_ids: Optional[torch.Tensor] = None
    seq_log_ratio: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Chunk:
    """One processed chunk: tokens ``start:end`` of the compacted batch."""

    start: int
    end: int
    h_lin: torch.Tensor  # [c, H] the (pre-scaled) hidden rows the logits GEMM used
    target: torch.Tensor  # [c] int64 target index inside this rank's shard (0 where not in the shard)
    in_shard: torch.Tensor  # [c] bool, True = the target lies in this rank's shard
    stats: ChunkStats


def _make_ops(run: Run, rows: int) -> tuple[Ops, torch.Tensor]:
    buffer = torch.empty(rows, run.weight.shape[0], dtype=run.weight.dtype, device=run.weight.device)
    ops_cls = TritonOps if run.impl == "triton" else TorchOps
    return ops_cls(buffer, run.acc_dtype), buffer


def iterate_chunks(run: Run, batch: TokenBatch) -> Iterator[tuple[Chunk, Ops]]:
    """Yields each chunk with its merged statistics; the ops hold the chunk's buffer until the next step.

    Args:
        run: the loop settings.
        batch: the compacted token inputs (only ``rows`` and ``targets`` are used here).

    Yields:
        ``(chunk, ops)``; call ``ops.grads`` before advancing to use the chunk's buffer.
    """
    n = batch.targets.shape[0]
    if n == 0:
        return
    vocab_shard = run.weight.shape[0]
    _, rank = group_size_rank(run.group)
    local = batch.targets - rank * vocab_shard
    in_shard = (local >= 0) & (local < vocab_shard)
    local = torch.where(in_shard, local, 0)
    ops, buffer = _make_ops(run, min(run.chunk_size, n))
    pre, post = run.scales
    for start in range(0, n, buffer.shape[0]):
        end = min(start + buffer.shape[0], n)
        h_lin = run.hidden[start:end] if batch.rows is None else run.hidden.index_select(0, batch.rows[start:end])
        if pre != 1.0:
            h_lin = h_lin * pre
        y = torch.mm(h_lin, run.weight.t(), out=buffer[: end - start])
        lse_r, target_r, entropy_r = ops.local_stats(y, post, local[start:end], in_shard[start:end], run.entropy)
        stats = merge_stats(lse_r, target_r, entropy_r, run.group)
        yield Chunk(start, end, h_lin, local[start:end], in_shard[start:end], stats), ops


def _chunk_loss(
    logp: torch.Tensor, batch: TokenBatch, part: slice, params: ObjectiveParams, need_grad: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """``(sum_k w_k loss_k [0-dim], d that / d logp [c] or None, metric sums)`` for one chunk via algo."""
    def take(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if x is None else x[part]

    leaf = logp.detach().requires_grad_(need_grad)
    mask = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)  # compacted: every token is valid
    with torch.enable_grad():
        per_token, sums = loss_parts.token_loss(
            leaf, take(batch.behavior_logp), take(batch.advantages), mask, params,
            ref_logp=take(batch.ref_logp), tis_weights=take(batch.tis_weights), seq_log_ratio=take(batch.seq_log_ratio),
        )
        total = (per_token * batch.weights[part]).sum()
    grad = torch.autograd.grad(total, leaf)[0] if need_grad and total.requires_grad else None
    if need_grad and grad is None:
        grad = torch.zeros_like(leaf)
    return total.detach(), grad, sums


def with_sequence_log_ratio(run: Run, batch: TokenBatch) -> TokenBatch:
    """The batch with each token's sequence log-ratio, from a first pass that computes every valid token's log-prob
    (GEMM 1 and the softmax statistics, no gradients). A sequence-level ratio needs all of its tokens before any
    token's gradient: this pass costs one more logits GEMM (the loop's three become four, ~+33%) and [n] floats,
    never [n, V]. A micro-batch without a valid token gets an empty ratio: the objective still runs (on no token),
    so its metric sums come out as algo's zeros."""
    parts = [chunk.stats.target_logit - chunk.stats.lse for chunk, _ in iterate_chunks(run, batch)]
    if not parts:
        return dataclasses.replace(batch, seq_log_ratio=torch.zeros(0, dtype=run.acc_dtype, device=run.hidden.device))
    logp = torch.cat(parts)
    every = torch.ones(logp.shape, dtype=torch.bool, device=logp.device)  # compacted: every token is valid
    ratio = objectives.sequence_log_ratio(logp, batch.behavior_logp.to(logp.dtype), every, seq_ids=batch.seq_ids)
    return dataclasses.replace(batch, seq_log_ratio=ratio)


def fused_loss_and_grads(
    run: Run, batch: TokenBatch, params: ObjectiveParams, need_grad_h: bool, need_grad_w: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Loss, metric sums and (eagerly) the gradients of hidden and weight.

    Args:
        run: the loop settings.
        batch: the compacted token inputs.
        params: objective switches.
        need_grad_h: compute ``d loss / d hidden``.
        need_grad_w: compute ``d loss / d weight``.

    Returns:
        ``(loss 0-dim, metric sums, grad_hidden [N, H] (TP all-reduced) or None, grad_weight [V/tp, H] or None)``.
    """
    acc, (n, hidden_size) = run.acc_dtype, run.hidden.shape
    if params.sequence_ratio:
        batch = with_sequence_log_ratio(run, batch)
    # written by the first chunk's GEMM (beta = 0): no separate zero-fill pass over [V/tp, H]
    grad_w = torch.empty(run.weight.shape, dtype=acc, device=run.weight.device) if need_grad_w else None
    grad_h = torch.zeros(n, hidden_size, dtype=acc, device=run.hidden.device) if need_grad_h else None
    loss = torch.zeros((), dtype=torch.float64, device=run.hidden.device)
    sums: dict[str, torch.Tensor] = {}
    pre, post = run.scales
    for chunk, ops in iterate_chunks(run, batch):
        part = slice(chunk.start, chunk.end)
        logp = chunk.stats.target_logit - chunk.stats.lse
        total, g, chunk_sums = _chunk_loss(logp, batch, part, params, need_grad_h or need_grad_w)
        loss += total.double()
        if chunk.stats.entropy is not None:
            chunk_sums["entropy_sum"] = chunk.stats.entropy.sum().to(total.dtype)
        for key, value in chunk_sums.items():
            sums[key] = sums[key] + value if key in sums else value
        if g is None:
            continue
        gh = ops.grads(run.weight, chunk.h_lin, chunk.target, chunk.in_shard, g.to(acc) * post, chunk.stats,
                       grad_w, need_grad_h, overwrite=chunk.start == 0)
        if gh is not None and grad_h is not None:
            gh = gh.mul_(pre) if pre != 1.0 else gh
            if batch.rows is None:
                grad_h[part] = gh
            else:
                grad_h.index_copy_(0, batch.rows[part], gh)
    if not sums:  # no valid token: zero gradient, and algo's zero sums from an empty chunk
        if grad_w is not None:
            grad_w.zero_()
        empty = torch.zeros(0, dtype=acc, device=run.hidden.device)
        sums = _chunk_loss(empty, batch, slice(0, 0), params, False)[2]
    if run.entropy and "entropy_sum" not in sums:
        sums["entropy_sum"] = torch.zeros((), dtype=sums["token_count"].dtype, device=run.hidden.device)
    if grad_h is not None:
        grad_h = all_reduce_sum(grad_h, run.group).to(run.hidden.dtype)
    if grad_w is not None:
        grad_w = grad_w.to(run.weight.dtype)
    return loss.to(acc), sums, grad_h, grad_w
