"""Per-token preparation before the chunk loop, all through algo: validation, truncated-IS weights,
aggregation weights, and compaction to the valid tokens.

The aggregation is linear in the per-token losses, so ``loss = sum_t w_t * per_token_loss_t`` with
``w = d aggregate / d per_token_loss``; the weights are taken by autograd from algo's ``aggregate`` itself
(token-mean, sequence-mean-of-token-means, token-sum / constant; local or global counts), never re-derived here.
Masked tokens have ``w = 0`` and contribute neither loss nor gradient, so the loop skips them.

Shape notation: N tokens, n valid tokens (loss mask True).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_offgrpo.algo import ObjectiveParams, loss_parts
from megatron_offgrpo.kernels._driver import TokenBatch


def _is_weights(
    behavior_logp: torch.Tensor,
    fleet_logp: Optional[torch.Tensor],
    tis_weights: Optional[torch.Tensor],
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    layout: dict,
) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """The truncated-IS weights to apply and their statistics (as ``reference_loss`` does)."""
    if fleet_logp is None:
        if params.tis_cap is not None and tis_weights is None:
            raise ValueError(
                f"tis_cap={params.tis_cap} needs fleet_logp (the inference engine's log-probs) or precomputed "
                "tis_weights; pass one of them or set tis_cap=None"
            )
        return tis_weights, {}
    weights, stats = loss_parts.truncated_is_weights(
        behavior_logp, fleet_logp, loss_mask, params.tis_cap, params.tis_level, **layout
    )
    return (weights if params.tis_cap is not None else None), stats


def aggregation_weights(
    loss_mask: torch.Tensor, params: ObjectiveParams, dtype: torch.dtype, **normalisers
) -> torch.Tensor:
    """[N] ``d aggregate / d per_token_loss``: the weight of each token's loss in the scalar loss.

    Args:
        loss_mask: [N] bool, True = token enters the loss.
        params: uses ``aggregation`` and ``aggregation_constant``.
        dtype: dtype of the weights.
        **normalisers: ``seq_ids``, ``cu_seqlens``, ``global_token_count``, ``global_seq_count`` (see ``aggregate``).

    Returns:
        [N] weights (0 where ``loss_mask`` is False).
    """
    probe = torch.zeros(loss_mask.shape[0], dtype=dtype, device=loss_mask.device, requires_grad=True)
    with torch.enable_grad():
        total = loss_parts.aggregate(probe, loss_mask, params, **normalisers)
    if not total.requires_grad:
        return torch.zeros_like(probe).detach()
    grad = torch.autograd.grad(total, probe, allow_unused=True)[0]
    return torch.zeros_like(probe).detach() if grad is None else grad


def prepare_batch(
    targets: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    acc_dtype: torch.dtype,
    optional: dict,
    normalisers: dict,
    valid_rows: Optional[torch.Tensor] = None,
) -> tuple[TokenBatch, dict[str, torch.Tensor]]:
    """Validates the per-token inputs and builds the compacted batch.

    Args:
        targets: [N] int64 target ids.
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        loss_mask: [N] bool, True = token enters the loss.
        params: objective switches.
        acc_dtype: dtype of the log-probs the loop computes.
        optional: ``ref_logp``, ``fleet_logp``, ``tis_weights`` (each [N] or None).
        normalisers: ``seq_ids``, ``cu_seqlens``, ``global_token_count``, ``global_seq_count``.
        valid_rows: [n] the indices where ``loss_mask`` is True, if the caller knows them (else found here: on CUDA
            a host synchronisation, since n sizes the compacted batch).

    Returns:
        ``(batch, tis statistics)``.
    """
    layout = {"seq_ids": normalisers["seq_ids"], "cu_seqlens": normalisers["cu_seqlens"]}
    zeros = torch.zeros(targets.shape[0], dtype=acc_dtype, device=targets.device)
    seq_ids = loss_parts.resolve_seq_ids(targets.shape[0], **layout)[0] if params.sequence_ratio else None
    with torch.no_grad():  # dry run on the full batch: algo's own checks of shapes, dtypes and switches
        loss_parts.token_loss(zeros, behavior_logp, advantages, loss_mask, params, ref_logp=optional["ref_logp"],
                              tis_weights=optional["tis_weights"],
                              seq_log_ratio=zeros if params.sequence_ratio else None)
    tis, tis_stats = _is_weights(
        behavior_logp, optional["fleet_logp"], optional["tis_weights"], loss_mask, params, layout
    )
    weights = aggregation_weights(loss_mask, params, acc_dtype, **normalisers)
    valid = loss_mask.nonzero().squeeze(1) if valid_rows is None else valid_rows
    rows = None if valid.numel() == loss_mask.shape[0] else valid

    def take(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return x if x is None or rows is None else x.index_select(0, rows)

    batch = TokenBatch(
        rows=rows, targets=take(targets), behavior_logp=take(behavior_logp), advantages=take(advantages),
        weights=take(weights), ref_logp=take(optional["ref_logp"]), tis_weights=take(tis), seq_ids=take(seq_ids),
    )
    return batch, tis_stats
