"""Per-token losses -> one scalar: token-mean, sequence-mean of token-means, or token-sum / constant.

Data parallelism: algo is pure, so the caller all-reduces the counts and passes them in. Each rank then
returns its SHARE of the global value (local sum / global count): SUMMING the ranks' results (or their
gradients) gives the loss over the global batch. Counts below 1 are treated as 1, so an all-masked batch
gives loss 0 and gradient 0, never NaN.

Shape notation: N = tokens flattened over the packed batch, S = sequences in the pack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from megatron_offgrpo.algo._checks import check_per_token
from megatron_offgrpo.algo._packing import resolve_seq_ids, segment_sum
from megatron_offgrpo.algo._params import AGGREGATIONS, ObjectiveParams

Count = Union[float, int, torch.Tensor]


def _denominator(name: str, given: Optional[Count], local: torch.Tensor) -> Union[float, torch.Tensor]:
    """``given`` (validated) or the local count, floored at 1."""
    if given is None:
        return local.clamp_min(1)
    if isinstance(given, torch.Tensor):
        if given.numel() != 1:
            raise ValueError(f"{name} has shape {tuple(given.shape)}; pass a scalar (a 0-dim tensor or a float)")
        return given.reshape(()).to(local.dtype).clamp_min(1)
    if isinstance(given, bool) or not isinstance(given, (int, float)) or not math.isfinite(given) or given < 0:
        raise ValueError(f"{name}={given!r} must be a finite count >= 0 (the all-reduced number of valid units)")
    return max(float(given), 1.0)


@dataclass(frozen=True)
class _Normalisers:
    """What the caller passed besides the losses (see ``aggregate``)."""

    seq_ids: Optional[torch.Tensor]
    cu_seqlens: Optional[torch.Tensor]
    global_token_count: Optional[Count]
    global_seq_count: Optional[Count]


def _token_mean(loss: torch.Tensor, mask: torch.Tensor, params: ObjectiveParams, norm: _Normalisers) -> torch.Tensor:
    return loss.sum() / _denominator("global_token_count", norm.global_token_count, mask.sum().to(loss.dtype))


def _seq_mean_token_mean(
    loss: torch.Tensor, mask: torch.Tensor, params: ObjectiveParams, norm: _Normalisers
) -> torch.Tensor:
    ids, num_seqs = resolve_seq_ids(loss.shape[0], norm.seq_ids, norm.cu_seqlens)
    seq_sum = segment_sum(loss, ids, num_seqs)
    seq_count = segment_sum(mask.to(loss.dtype), ids, num_seqs)
    per_seq = seq_sum / seq_count.clamp_min(1)
    local = (seq_count > 0).sum().to(loss.dtype)  # sequences with >= 1 valid token
    return per_seq.sum() / _denominator("global_seq_count", norm.global_seq_count, local)


def _token_sum_norm(
    loss: torch.Tensor, mask: torch.Tensor, params: ObjectiveParams, norm: _Normalisers
) -> torch.Tensor:
    assert params.aggregation_constant is not None  # ObjectiveParams.validate() requires it for this mode
    return loss.sum() / params.aggregation_constant


_Aggregator = Callable[[torch.Tensor, torch.Tensor, ObjectiveParams, _Normalisers], torch.Tensor]
_AGGREGATORS: dict[str, _Aggregator] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "token_sum_norm": _token_sum_norm,
}
assert tuple(_AGGREGATORS) == AGGREGATIONS


def aggregate(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    *,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    global_token_count: Optional[Count] = None,
    global_seq_count: Optional[Count] = None,
) -> torch.Tensor:
    """Reduces per-token losses to a scalar according to ``params.aggregation``.

    - ``token_mean``: ``sum_valid loss / global_token_count`` (default: local valid-token count).
    - ``seq_mean_token_mean``: ``sum_s (sum_{valid t in s} loss_t / n_s) / global_seq_count`` over sequences
      with ``n_s >= 1`` valid tokens (default: their local number). Needs ``seq_ids`` or ``cu_seqlens``.
    - ``token_sum_norm``: ``sum_valid loss / aggregation_constant`` (Dr.GRPO; to match its reference code pass
      constant = max response length x global number of sequences).

    Args:
        per_token_loss: [N] per-token loss (from ``token_loss``).
        loss_mask: [N] bool, True = token enters the loss (and the normaliser).
        params: uses ``aggregation`` and ``aggregation_constant``.
        seq_ids: [N] sequence id per token (``seq_mean_token_mean`` only; or ``cu_seqlens``).
        cu_seqlens: [S + 1] packed boundaries (``seq_mean_token_mean`` only; or ``seq_ids``).
        global_token_count: valid tokens over the data-parallel group (float or 0-dim tensor), or None.
        global_seq_count: sequences with >= 1 valid token over the data-parallel group, or None.

    Returns:
        0-dim loss, differentiable w.r.t. ``per_token_loss``; masked positions never contribute.

    Raises:
        ValueError: on mismatched shapes, a bad count, or a missing/malformed layout for sequence-mean.
    """
    check_per_token(loss_mask, per_token_loss=per_token_loss)
    loss = torch.where(loss_mask, per_token_loss, per_token_loss.new_zeros(()))
    norm = _Normalisers(seq_ids, cu_seqlens, global_token_count, global_seq_count)
    return _AGGREGATORS[params.aggregation](loss, loss_mask, params, norm)
