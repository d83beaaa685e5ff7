"""The unfused reference loss: materialised logits -> log-probs -> ``token_loss`` -> ``aggregate``.

This is the oracle the fused kernel and the trainer are tested against. It materialises ``[N, V]``
log-probs, so use it on small batches.

Shape notation: N = tokens flattened over the packed batch, S = sequences in the pack, V = vocabulary.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_offgrpo.algo._aggregate import Count, aggregate
from megatron_offgrpo.algo._checks import check_1d, check_per_token
from megatron_offgrpo.algo._objectives import sequence_log_ratio
from megatron_offgrpo.algo._params import ObjectiveParams
from megatron_offgrpo.algo._tis import truncated_is_weights
from megatron_offgrpo.algo._token_loss import finalize_metrics, token_loss


def _target_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_softmax(logits / T) [N, V], its value at the targets [N])``; masked rows are zeroed first."""
    check_per_token(loss_mask)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != loss_mask.shape[0]:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits has shape {shape}; it must be [N, V] with N={loss_mask.shape[0]} (loss_mask)")
    if not logits.is_floating_point():
        raise ValueError(f"logits has dtype {logits.dtype}; it must be floating")
    check_1d("targets", targets, loss_mask.shape[0])
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets has dtype {targets.dtype}; it must hold integer token ids; cast with .long()")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be a number > 0 (the sampling temperature)")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature!r} must be finite")
    work = logits.to(torch.promote_types(logits.dtype, torch.float32))
    work = torch.where(loss_mask.unsqueeze(1), work, 0) / temperature  # garbage rows cannot poison the grad
    logprobs = torch.log_softmax(work, dim=-1)
    safe_targets = torch.where(loss_mask, targets, 0).long()  # e.g. -100 ignore ids at masked positions
    return logprobs, logprobs.gather(1, safe_targets.unsqueeze(1)).squeeze(1)


def _tis(
    behavior_logp: torch.Tensor,
    fleet_logp: Optional[torch.Tensor],
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    seq_ids: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """Truncated-IS weights to apply (None unless ``tis_cap`` is set) and their stats (empty without fleet)."""
    if fleet_logp is None:
        if params.tis_cap is not None:
            raise ValueError(
                f"tis_cap={params.tis_cap} needs fleet_logp (the inference engine's log-probs); "
                "pass fleet_logp or set tis_cap=None"
            )
        return None, {}
    weights, stats = truncated_is_weights(
        behavior_logp,
        fleet_logp,
        loss_mask,
        params.tis_cap,
        params.tis_level,
        seq_ids=seq_ids,
        cu_seqlens=cu_seqlens,
    )
    return (weights if params.tis_cap is not None else None), stats


def reference_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    *,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    ref_logp: Optional[torch.Tensor] = None,
    fleet_logp: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    global_token_count: Optional[Count] = None,
    global_seq_count: Optional[Count] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference loss: ``logp = log_softmax(logits / T)[targets]`` (>= float32), ``token_loss``, ``aggregate``.

    With ``fleet_logp``, truncated-IS weights ``min(exp(behavior_logp - fleet_logp), tis_cap)`` are computed and
    their statistics reported; they weight the loss only when ``params.tis_cap`` is set.

    Args:
        logits: [N, V] logits of the next token at each position (rows where ``loss_mask`` is False are ignored).
        targets: [N] integer id of the sampled next token (any value where ``loss_mask`` is False).
        behavior_logp: [N] trainer log-probs under the behavior policy that generated the samples.
        advantages: [N] per-token advantages (``broadcast_to_tokens`` of ``GroupAdvantages.advantages``).
        loss_mask: [N] bool, True = response token of a valid sample (AND it with the broadcast
            ``GroupAdvantages.sample_valid`` so masked groups leave the loss and its normaliser).
        params: objective switches.
        seq_ids: [N] sequence id per token (needed by ``seq_mean_token_mean``, sequence-level TIS and gspo).
        cu_seqlens: [S + 1] packed boundaries (alternative to ``seq_ids``).
        ref_logp: [N] reference-policy log-probs (for the KL term / metric).
        fleet_logp: [N] the fleet's log-probs (for truncated IS); required when ``params.tis_cap`` is set.
        temperature: sampling temperature T > 0 the logits are divided by.
        compute_entropy: also report the mean entropy of ``softmax(logits / T)`` over valid tokens.
        global_token_count: see ``aggregate``.
        global_seq_count: see ``aggregate``.

    Returns:
        ``(loss 0-dim, metrics)``: the raw sums (all-reducible), their ``finalize_metrics``, ``loss`` (detached).

    Raises:
        ValueError: on any malformed input, or ``tis_cap`` set without ``fleet_logp``.
    """
    logprobs, logp = _target_logprobs(logits, targets, loss_mask, temperature)
    tis_weights, sums = _tis(behavior_logp, fleet_logp, loss_mask, params, seq_ids, cu_seqlens)
    layout = {"seq_ids": seq_ids, "cu_seqlens": cu_seqlens}
    seq_log_ratio = sequence_log_ratio(logp, behavior_logp, loss_mask, **layout) if params.sequence_ratio else None
    per_token, token_sums = token_loss(logp, behavior_logp, advantages, loss_mask, params, ref_logp=ref_logp,
                                       tis_weights=tis_weights, seq_log_ratio=seq_log_ratio)
    counts = {"global_token_count": global_token_count, "global_seq_count": global_seq_count}
    loss = aggregate(per_token, loss_mask, params, **layout, **counts)
    sums.update(token_sums)
    if compute_entropy:
        with torch.no_grad():  # -sum p log p, with entr(0) = 0 so p = 0 never gives NaN
            entropy = torch.special.entr(logprobs.exp()).sum(dim=-1)
            sums["entropy_sum"] = torch.where(loss_mask, entropy, 0).sum()
    return loss, {**sums, **finalize_metrics(sums), "loss": loss.detach()}
