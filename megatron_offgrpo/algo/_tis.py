"""Truncated importance sampling (TIS) for the trainer / inference-engine mismatch.

The fleet (vLLM) and the trainer compute slightly different log-probs for the same weights. With
``logp_old_trainer`` the trainer's log-prob under the behavior weights and ``logp_fleet`` the fleet's, the
weight is ``min(exp(logp_old_trainer - logp_fleet), C)`` per token, or per sequence with the summed
log-ratio of the sequence; it multiplies the per-token policy loss as a detached factor (Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training", as in verl / slime).

Shape notation: N = tokens flattened over the packed batch, S = sequences in the pack.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from megatron_offgrpo.algo._checks import check_per_token
from megatron_offgrpo.algo._packing import resolve_seq_ids, segment_sum


def _check_cap(cap: Optional[float], level: str) -> None:
    if cap is not None and (
        not isinstance(cap, (int, float)) or isinstance(cap, bool) or not math.isfinite(cap) or cap <= 0
    ):
        raise ValueError(f"cap={cap!r} must be a finite number > 0 (or None for no truncation); e.g. cap=2.0")
    if level not in ("token", "sequence"):
        raise ValueError(f"level={level!r} is not one of ('token', 'sequence'); pick one of them")


def _ratio_stats(raw: torch.Tensor, weights: torch.Tensor, units: torch.Tensor) -> dict[str, torch.Tensor]:
    """All-reducible sums (SUM) and extremes (MAX / MIN) over the units (tokens or sequences) that count."""
    dtype = torch.promote_types(raw.dtype, torch.float32)
    raw, weights = raw.to(dtype), weights.to(dtype)
    inf = torch.full((), math.inf, dtype=dtype, device=raw.device)  # a fill, not a host-to-device copy
    return {
        "tis_unit_count": units.sum().to(dtype),
        "tis_raw_sum": torch.where(units, raw, 0).sum(),
        "tis_raw_max": torch.where(units, raw, -inf).max() if raw.numel() else -inf,
        "tis_raw_min": torch.where(units, raw, inf).min() if raw.numel() else inf,
        "tis_truncated_count": (units & (weights < raw)).sum().to(dtype),
        "tis_weight_sum": torch.where(units, weights, 0).sum(),
    }


def truncated_is_weights(
    trainer_old_logp: torch.Tensor,
    fleet_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: Optional[float],
    level: Literal["token", "sequence"] = "token",
    *,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS weights and the statistics of the raw (pre-truncation) ratios.

    ``level="token"``: ``w_t = min(exp(old_t - fleet_t), cap)``. ``level="sequence"``: ``w_t = min(exp(sum over
    the valid tokens of t's sequence of (old - fleet)), cap)`` for every token of the sequence. The raw ratio is
    not clamped (an overflow to inf truncates to ``cap``; the raw max then reads inf).

    Args:
        trainer_old_logp: [N] trainer log-probs under the behavior weights.
        fleet_logp: [N] the fleet's log-probs of the same tokens.
        loss_mask: [N] bool, True = the token enters the loss (others get weight 0 and are not counted).
        cap: truncation C > 0, or None = no truncation (weights = raw ratios; for monitoring).
        level: ``"token"`` or ``"sequence"``.
        seq_ids: [N] sequence id per token (sequence level only; give this or ``cu_seqlens``).
        cu_seqlens: [S + 1] packed boundaries (sequence level only).

    Returns:
        ``(weights [N] detached, 0 where loss_mask is False; stats)``. ``stats`` holds detached 0-dim tensors
        over the counted units (valid tokens, or sequences with >= 1 valid token): ``tis_unit_count``,
        ``tis_raw_sum``, ``tis_truncated_count`` and ``tis_weight_sum`` (all-reduce with SUM), ``tis_raw_max``
        (MAX; -inf when nothing counts) and ``tis_raw_min`` (MIN; +inf when nothing counts).
        ``finalize_metrics`` turns them into means and fractions.

    Raises:
        ValueError: on mismatched shapes or dtypes, a bad ``cap`` or ``level``, or a missing/malformed layout at
            sequence level.
    """
    n = check_per_token(loss_mask, trainer_old_logp=trainer_old_logp, fleet_logp=fleet_logp)
    _check_cap(cap, level)
    with torch.no_grad():
        log_ratio = torch.where(loss_mask, trainer_old_logp - fleet_logp, 0)
        if level == "token":
            raw, units = torch.exp(log_ratio), loss_mask
        else:
            ids, num_seqs = resolve_seq_ids(n, seq_ids, cu_seqlens)
            raw = torch.exp(segment_sum(log_ratio, ids, num_seqs))
            units = segment_sum(loss_mask.to(log_ratio.dtype), ids, num_seqs) > 0
        weights = raw if cap is None else raw.clamp(max=cap)
        stats = _ratio_stats(raw, weights, units)
        per_token = weights if level == "token" else weights[ids]
        per_token = torch.where(loss_mask, per_token, 0)
    return per_token, stats
