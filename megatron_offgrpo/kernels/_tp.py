"""Vocab-parallel bookkeeping: which vocab rows this rank holds, and the per-chunk statistics merge.

Megatron splits the (padded) vocabulary of the output layer evenly over the tensor-parallel (TP) group:
rank r holds rows ``[r * V/tp, (r + 1) * V/tp)``. Each rank computes, per token, the log-sum-exp of its own
shard (``lse_r``), the target logit if the target lies in its shard, and optionally its shard's entropy. One
all-gather of these ``[3, c]`` statistics per chunk gives every rank the global values exactly:

    lse = logsumexp_r lse_r
    target logit = sum_r (target logit on r, 0 where the target is not in r's shard)
    entropy = sum_r rho_r (H_r - log rho_r),   rho_r = exp(lse_r - lse) = the probability mass on shard r

(gathering the local log-sum-exps is one collective and as accurate as max-then-sum-exp, which needs two).

Shape notation: c tokens of one chunk, V/tp vocabulary rows of this rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


def group_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(TP size, TP rank)`` of ``group``; ``(1, 0)`` for None (no tensor parallelism)."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass(frozen=True)
class ChunkStats:
    """Per-token statistics of one chunk over the FULL vocabulary (identical on every TP rank).

    Attributes:
        lse: [c] log-sum-exp of the tempered logits over the full vocabulary.
        target_logit: [c] tempered logit of the target token.
        entropy: [c] entropy of the full softmax, or None when not asked for.
        local_mass: [c] ``exp(lse_r - lse)``: the probability mass held by this rank's shard (1 without TP).
    """

    lse: torch.Tensor
    target_logit: torch.Tensor
    entropy: Optional[torch.Tensor]
    local_mass: torch.Tensor


def merge_stats(
    lse_r: torch.Tensor,
    target_r: torch.Tensor,
    entropy_r: Optional[torch.Tensor],
    group: Optional[dist.ProcessGroup],
) -> ChunkStats:
    """Merges this rank's shard statistics into full-vocabulary ones with one all-gather.

    Args:
        lse_r: [c] log-sum-exp over this rank's shard.
        target_r: [c] target logit where the target is in this rank's shard, exactly 0 elsewhere.
        entropy_r: [c] entropy of the shard-local softmax, or None.
        group: the TP process group, or None.

    Returns:
        The merged :class:`ChunkStats`.
    """
    tp, rank = group_size_rank(group)
    if tp == 1:
        return ChunkStats(lse_r, target_r, entropy_r, torch.ones_like(lse_r))
    rows = [lse_r, target_r] + ([entropy_r] if entropy_r is not None else [])
    local = torch.stack(rows).contiguous()  # [2 or 3, c]; gloo needs contiguous buffers
    gathered = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(gathered, local, group=group)
    every = torch.stack(gathered)  # [tp, 2 or 3, c]
    lse = torch.logsumexp(every[:, 0], dim=0)
    log_mass = every[:, 0] - lse  # [tp, c]
    entropy = None
    if entropy_r is not None:
        entropy = (log_mass.exp() * (every[:, 2] - log_mass)).sum(dim=0)
    return ChunkStats(lse, every[:, 1].sum(dim=0), entropy, log_mass[rank].exp())


def all_reduce_sum(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """In-place SUM all-reduce over ``group`` (no-op without TP); returns ``tensor``."""
    if group_size_rank(group)[0] > 1:
        assert tensor.is_contiguous()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor
