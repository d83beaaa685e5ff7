"""The per-token loss: objective x truncated-IS factor + beta x KL, masked; and metric finalisation.

``token_loss`` is elementwise in ``logp`` and differentiable w.r.t. it ONLY, so the fused kernel can compute
``logp`` chunk by chunk without ``[N, V]`` logits, call this on ``[N]`` tensors and take ``d loss / d logp``
with autograd. Masked positions give exactly 0 loss and 0 gradient, whatever ``logp`` holds there (-inf,
NaN, garbage): every input is replaced by 0 there BEFORE any math, and the loss is selected with ``where``.

Shape notation: N = tokens flattened over the packed batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_offgrpo.algo._checks import check_per_token
from megatron_offgrpo.algo._kl import kl_penalty
from megatron_offgrpo.algo._params import ObjectiveParams
from megatron_offgrpo.algo._registry import ObjectiveTerms, get_objective


def _masked(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def token_loss(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: ObjectiveParams,
    ref_logp: Optional[torch.Tensor] = None,
    tis_weights: Optional[torch.Tensor] = None,
    seq_log_ratio: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss ``tis * objective(logp) + kl_beta * KL(logp, ref)``, zero where ``loss_mask`` is False.

    The truncated-IS factor multiplies the policy term only (as in slime and verl); the KL term is added
    unweighted. All inputs but ``logp`` are used detached. Only shapes and dtypes are checked (no value
    scan, so no host sync in the fused kernel's hot loop).

    Args:
        logp: [N] log-prob of each target token under the current policy (the only differentiable input).
        behavior_logp: [N] log-prob under the behavior policy that generated the sample.
        advantages: [N] the sample's advantage broadcast to its tokens (see ``broadcast_to_tokens``).
        loss_mask: [N] bool, True = response token of a valid sample that enters the loss.
        params: objective switches.
        ref_logp: [N] reference-policy log-probs; required when ``params.kl_beta > 0``. When given with
            ``kl_beta == 0`` the KL is still measured (metric only).
        tis_weights: [N] truncated-IS weights from ``truncated_is_weights``, or None.
        seq_log_ratio: [N] ``sequence_log_ratio`` of each token's sequence; required by a sequence-level objective
            (``params.sequence_ratio``: gspo), ignored otherwise. Only it makes such an objective elementwise, so the
            fused kernel computes it in a first pass over the sequences' log-probs.

    Returns:
        ``(per_token_loss [N], metric_sums)``. ``metric_sums`` holds detached 0-dim float tensors, summed over
        valid tokens so that a SUM all-reduce then ``finalize_metrics`` gives global values: ``token_count``,
        ``clip_low_count``, ``clip_high_count``, ``dual_clip_count``, ``kl_sum`` (0 without ``ref_logp``).

    Raises:
        ValueError: on mismatched shapes, non-bool mask, non-floating inputs, or ``kl_beta > 0`` without
            ``ref_logp``.
    """
    inputs = {"logp": logp, "behavior_logp": behavior_logp, "advantages": advantages}
    check_per_token(loss_mask, **inputs, ref_logp=ref_logp, tis_weights=tis_weights, seq_log_ratio=seq_log_ratio)
    if params.kl_beta > 0 and ref_logp is None:
        raise ValueError(
            f"kl_beta={params.kl_beta} needs ref_logp (the reference policy's log-probs); "
            "pass ref_logp or set kl_beta=0.0"
        )
    if params.sequence_ratio and seq_log_ratio is None:
        raise ValueError(
            f"objective={params.objective!r} needs seq_log_ratio (objectives.sequence_log_ratio over whole sequences)"
        )
    mask = loss_mask
    logp_s = _masked(mask, logp)
    policy, behavior = logp_s, _masked(mask, behavior_logp.detach())
    if params.sequence_ratio:
        policy, behavior = _sequence_ratio_inputs(logp_s, _masked(mask, seq_log_ratio.detach()))
    terms = get_objective(params.objective)(policy, behavior, _masked(mask, advantages.detach()), params)
    loss = terms.loss
    if tis_weights is not None:
        loss = loss * _masked(mask, tis_weights.detach())
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp_s, _masked(mask, ref_logp.detach()), params.kl_estimator)
        if params.kl_beta > 0:
            loss = loss + params.kl_beta * kl
    log_ratio = logp_s.detach() - _masked(mask, behavior_logp.detach())
    return _masked(mask, loss), _metric_sums(terms, kl, log_ratio, mask, logp.dtype)


def _sequence_ratio_inputs(logp: torch.Tensor, seq_log_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(policy, behavior)`` for a sequence-level objective (GSPO's token form): its ratio
    ``exp(policy - behavior)`` has the value ``s`` of the token's sequence and the gradient ``s grad logp_t``.

    That is ``log s_t = sg(log s) + logp_t - sg(logp_t)`` (Zheng et al.), split as ``policy = logp_t - sg(logp_t)``
    (exactly 0, the gradient of ``logp_t``) and ``behavior = -sg(log s)``: then ``policy - behavior = 0 + log s``
    is ``log s`` bit for bit, the same float for every token of a sequence, so the clip is decided once per
    sequence. (``behavior = sg(logp_t) - log s`` rounded ``logp_t - behavior`` differently for each token: at a
    sequence ratio on a clip edge, some tokens of one sequence were clipped and others not.)
    """
    return logp - logp.detach(), -seq_log_ratio


@torch.no_grad()
def _metric_sums(
    terms: ObjectiveTerms, kl: Optional[torch.Tensor], log_ratio: torch.Tensor, mask: torch.Tensor,
    dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Detached sums over valid tokens (``mask`` True), in at least float32. ``log_ratio_abs_sum``: |trainer -
    behavior log-prob|; on-policy (staleness 0, before the step's update) that is the trainer / engine mismatch."""
    dtype = torch.promote_types(dtype, torch.float32)
    return {
        "log_ratio_abs_sum": _masked(mask, log_ratio.abs()).sum().to(dtype),
        "token_count": mask.sum().to(dtype),
        "clip_low_count": (terms.clip_low & mask).sum().to(dtype),
        "clip_high_count": (terms.clip_high & mask).sum().to(dtype),
        "dual_clip_count": (terms.dual_clip & mask).sum().to(dtype),
        "kl_sum": _masked(mask, kl).sum().to(dtype) if kl is not None else mask.new_zeros((), dtype=dtype),
    }


def finalize_metrics(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Turns (all-reduced) metric sums into means and fractions; keys that are absent are skipped.

    Token metrics divide by ``token_count``; TIS metrics by ``tis_unit_count``; ``entropy_sum`` by
    ``token_count``. Denominators below 1 are treated as 1, and the TIS extremes read 0 when nothing counted,
    so an all-masked batch gives zeros, never NaN or inf.

    Args:
        sums: the ``metric_sums`` of ``token_loss`` (optionally merged with ``truncated_is_weights`` stats and
            ``entropy_sum``), after a SUM all-reduce of the sums and MAX/MIN of ``tis_raw_max``/``tis_raw_min``.

    Returns:
        Detached 0-dim tensors: ``clip_low_fraction``, ``clip_high_fraction``, ``clip_fraction``,
        ``dual_clip_fraction``, ``kl_mean``, ``entropy_mean``, ``log_ratio_abs_mean``, ``tis_raw_mean``,
        ``tis_raw_max``, ``tis_raw_min``, ``tis_truncated_fraction``, ``tis_weight_mean`` (each only when its
        inputs are present).
    """
    out: dict[str, torch.Tensor] = {}
    if "token_count" in sums:
        n = sums["token_count"].clamp_min(1)
        for name in ("clip_low", "clip_high", "dual_clip"):
            if f"{name}_count" in sums:
                out[f"{name}_fraction"] = sums[f"{name}_count"] / n
        if "clip_low_count" in sums and "clip_high_count" in sums:
            out["clip_fraction"] = (sums["clip_low_count"] + sums["clip_high_count"]) / n
        for name in ("kl", "entropy", "log_ratio_abs"):
            if f"{name}_sum" in sums:
                out[f"{name}_mean"] = sums[f"{name}_sum"] / n
    if "tis_unit_count" in sums:
        units = sums["tis_unit_count"]
        u = units.clamp_min(1)
        out["tis_raw_mean"] = sums["tis_raw_sum"] / u
        out["tis_truncated_fraction"] = sums["tis_truncated_count"] / u
        out["tis_weight_mean"] = sums["tis_weight_sum"] / u
        for name in ("tis_raw_max", "tis_raw_min"):
            out[name] = torch.where(units > 0, sums[name], torch.zeros_like(sums[name]))
    return {k: v.detach() for k, v in out.items()}
