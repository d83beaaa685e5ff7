"""The registered objectives: per-token policy losses as pure functions of ``logp``.

Notation per token: ``A`` advantage, ``rho = exp(logp - logp_b)`` the ratio of the current policy to the
behavior policy that generated the sample (the lagged policy in off-policy training), ``lo = 1 - eps_low``,
``hi = 1 + eps_high``. Every objective returns the UNMASKED loss; ``token_loss`` masks, weights and adds KL.

- ``grpo_clip``: ``-min(rho A, clip(rho, lo, hi) A)``; with ``dual_clip = c``: for A < 0 additionally
  ``min(that, -c A)`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL").
  With behavior == current (rho = 1, on-policy, v = 1) the gradient is ``-A grad logp``.
- ``gpg``: ``-A logp`` (Chu et al. 2025, "GPG"): no ratio, no clip.
- ``rec``: ``-w A logp * m`` (Yao et al. 2025, "Group-relative REINFORCE is secretly an off-policy
  algorithm"), ``w = 1`` (NoIS) or ``rho.detach()`` (IS), mask m from ``rec_clip`` (:func:`rec_keep_mask`).
  REC-OneSide-IS has exactly the ``grpo_clip`` gradient.
- ``opmd``: ``rec + tau (logp - logp_b)^2``. Kimi k1.5's OPMD has ``tau/2``; like the REC authors'
  reference implementation (Trinity-RFT ``rec_policy_loss.py``, regularizer "k2") the 1/2 is absorbed into tau.
- ``asymre``: ``rec - tau logp`` (Arnal et al. 2025, "Asymmetric REINFORCE"): the baseline shifted down by tau.
- ``cispo``: ``-sg(clip(rho, lo, hi)) A logp`` (MiniMax-M1, 2025): the importance weight is clipped and detached,
  so no token's gradient is dropped; a ratio outside the trust region only caps its weight.
- ``gspo``: the ``grpo_clip`` loss on the SEQUENCE ratio ``s = exp(mean_t (logp_t - logp_b,t))`` of the token's
  response, clipped to ``[1 - seq_eps_low, 1 + seq_eps_high]`` (Zheng et al. 2025, "Group Sequence Policy
  Optimization"), in its token form: ``token_loss`` passes ``logp = logp_t - sg(logp_t)`` (0) and
  ``behavior_logp = -log s`` so that each token's ratio is the sequence's ``s`` bit for bit (one clip decision per
  sequence) with the gradient ``s grad logp_t``; with ``seq_mean_token_mean`` aggregation this is exactly the
  gradient of the sequence-level objective.

The ratio's log is clamped to +-LOG_RATIO_CLAMP before ``exp`` (as verl does) so no valid token overflows.

Shape notation: N = tokens flattened over the packed batch.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_offgrpo.algo._kl import LOG_RATIO_CLAMP
from megatron_offgrpo.algo._packing import resolve_seq_ids, segment_sum
from megatron_offgrpo.algo._params import ObjectiveParams
from megatron_offgrpo.algo._registry import ObjectiveTerms, register_objective


def importance_ratio(logp: torch.Tensor, behavior_logp: torch.Tensor) -> torch.Tensor:
    """``rho = exp(clamp(logp - behavior_logp, +-LOG_RATIO_CLAMP))`` [N], differentiable w.r.t. ``logp``."""
    return torch.exp((logp - behavior_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _no_flags(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def _clipped_ratio_loss(
    rho: torch.Tensor, a: torch.Tensor, lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``-min(rho A, clip(rho, lo, hi) A)`` as a ``where`` (0 gradient on the clipped side), and the low / high
    clip flags."""
    clip_high = (a > 0) & (rho > hi)
    clip_low = (a < 0) & (rho < lo)
    loss = torch.where(clip_high | clip_low, -rho.detach().clamp(lo, hi) * a, -rho * a)
    return loss, clip_low, clip_high


@register_objective("grpo_clip")
def grpo_clip(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """Clipped-ratio GRPO/PPO loss ``-min(rho A, clip(rho) A)`` with optional dual clip.

    Written as a ``where`` so the gradient is exactly 0 on the clipped side: ``min`` picks the constant
    ``clip(rho) A`` iff (A > 0 and rho > hi) or (A < 0 and rho < lo); elsewhere the loss is ``-rho A``.
    At the boundaries (rho == lo or hi) the token counts as unclipped.

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        params: uses ``eps_low``, ``eps_high``, ``dual_clip``.

    Returns:
        The loss and the clip flags.
    """
    a = advantages
    rho = importance_ratio(logp, behavior_logp)
    loss, clip_low, clip_high = _clipped_ratio_loss(rho, a, 1.0 - params.eps_low, 1.0 + params.eps_high)
    dual = _no_flags(a)
    if params.dual_clip is not None:
        c = params.dual_clip
        dual = (a < 0) & (rho > c)  # then -rho A > -c A: the bound is active, the gradient is 0
        loss = torch.where(dual, -c * a, loss)
    return ObjectiveTerms(loss=loss, clip_low=clip_low, clip_high=clip_high, dual_clip=dual)


@register_objective("gpg")
def gpg(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """GPG loss ``-A logp``: no ratio, no clip (``behavior_logp`` and ``params`` are unused).

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] unused.
        advantages: [N] per-token advantages.
        params: unused.

    Returns:
        The loss; no clip flags are ever set.
    """
    flags = _no_flags(advantages)
    return ObjectiveTerms(loss=-advantages * logp, clip_low=flags, clip_high=flags, dual_clip=flags)


def rec_keep_mask(rho: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams) -> torch.Tensor:
    """REC token mask m [N] bool, True = the token keeps its gradient.

    - ``none``: all tokens.
    - ``one_side``: drops (A > 0 and rho > hi) or (A < 0 and rho < lo): exactly where PPO-clip's gradient is 0.
    - ``two_side``: keeps lo <= rho <= hi only.
    - ``ring`` (Yao et al.; definition as in the authors' Trinity-RFT ``rec_policy_loss.py``): keeps
      lo <= rho <= hi, plus (A >= 0 and rho <= 1 - eps_low_outer) plus (A <= 0 and rho >= 1 + eps_high_outer):
      far outside the trust region, tokens whose update would move the policy back towards the behavior
      policy (raise a good token that fell far, lower a bad token that rose far) are kept again.

    Args:
        rho: [N] importance ratio (only compared, never differentiated).
        advantages: [N] per-token advantages.
        params: uses ``rec_clip``, ``eps_low``, ``eps_high``, ``eps_low_outer``, ``eps_high_outer``.

    Returns:
        [N] bool, True = kept.
    """
    a, mode = advantages, params.rec_clip
    lo, hi = 1.0 - params.eps_low, 1.0 + params.eps_high
    if mode == "none":
        return torch.ones_like(a, dtype=torch.bool)
    if mode == "one_side":
        return ~(((a > 0) & (rho > hi)) | ((a < 0) & (rho < lo)))
    inside = (rho >= lo) & (rho <= hi)
    if mode == "two_side":
        return inside
    assert mode == "ring", mode  # ObjectiveParams.validate() admits only these four
    return inside | ((a >= 0) & (rho <= 1.0 - params.eps_low_outer)) | ((a <= 0) & (rho >= 1.0 + params.eps_high_outer))


@register_objective("rec")
def rec(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """REC loss ``-w A logp * m`` with ``w`` from ``rec_weight`` and ``m`` from :func:`rec_keep_mask`.

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        params: uses ``rec_weight``, ``rec_clip`` and the eps fields.

    Returns:
        The loss; ``clip_low`` / ``clip_high`` flag masked-out tokens below / above the trust region.
    """
    a = advantages
    rho = importance_ratio(logp, behavior_logp).detach()
    keep = rec_keep_mask(rho, a, params)
    weighted = a * rho if params.rec_weight == "is" else a
    loss = torch.where(keep, -weighted * logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    clip_low = ~keep & (rho < 1.0 - params.eps_low)
    clip_high = ~keep & (rho > 1.0 + params.eps_high)
    return ObjectiveTerms(loss=loss, clip_low=clip_low, clip_high=clip_high, dual_clip=_no_flags(a))


@register_objective("opmd")
def opmd(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """OPMD: the REC loss plus ``tau (logp - logp_b)^2`` on every token (REP family, Yao et al.).

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        params: the REC fields and ``tau``.

    Returns:
        The regularised loss and REC's clip flags.
    """
    terms = rec(logp, behavior_logp, advantages, params)
    reg = params.tau * (logp - behavior_logp) ** 2
    return ObjectiveTerms(terms.loss + reg, terms.clip_low, terms.clip_high, terms.dual_clip)


@register_objective("asymre")
def asymre(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """AsymRE: the REC loss minus ``tau logp`` on every token (plain REC: REINFORCE with ``A + tau``).

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        params: the REC fields and ``tau``.

    Returns:
        The regularised loss and REC's clip flags.
    """
    terms = rec(logp, behavior_logp, advantages, params)
    return ObjectiveTerms(terms.loss - params.tau * logp, terms.clip_low, terms.clip_high, terms.dual_clip)


@register_objective("cispo")
def cispo(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """CISPO loss ``-sg(clip(rho, 1 - eps_low, 1 + eps_high)) A logp``: REINFORCE with a truncated, detached
    importance weight. Where ``grpo_clip`` drops a clipped token's gradient, CISPO keeps it at the capped weight.

    Args:
        logp: [N] current log-probs (requires grad).
        behavior_logp: [N] behavior-policy log-probs.
        advantages: [N] per-token advantages.
        params: uses ``eps_low``, ``eps_high`` (``eps_low = 1``: no lower bound, as MiniMax-M1 ran it).

    Returns:
        The loss; ``clip_low`` / ``clip_high`` flag tokens whose weight was capped (their gradient is kept).
    """
    a = advantages
    rho = importance_ratio(logp, behavior_logp).detach()
    lo, hi = 1.0 - params.eps_low, 1.0 + params.eps_high
    return ObjectiveTerms(loss=-rho.clamp(lo, hi) * a * logp, clip_low=rho < lo, clip_high=rho > hi,
                          dual_clip=_no_flags(a))


@register_objective("gspo")
def gspo(
    logp: torch.Tensor, behavior_logp: torch.Tensor, advantages: torch.Tensor, params: ObjectiveParams
) -> ObjectiveTerms:
    """GSPO-token loss: ``grpo_clip``'s clipped ratio with the sequence clip range ``seq_eps_low / seq_eps_high``.

    Args:
        logp: [N] ``logp_t - sg(logp_t)`` as ``token_loss`` builds it: value 0, the gradient of the current
            log-prob (only the ratio is used, never ``logp``'s value).
        behavior_logp: [N] ``-log s`` from ``sequence_log_ratio``: the ratio ``exp(logp - behavior_logp)`` then has
            the sequence ratio's exact value (one float per sequence) and the token's gradient.
        advantages: [N] per-token advantages (one value per sequence).
        params: uses ``seq_eps_low``, ``seq_eps_high``.

    Returns:
        The loss; the clip flags mark every token of a clipped sequence (all of its tokens or none).
    """
    rho = importance_ratio(logp, behavior_logp)
    loss, clip_low, clip_high = _clipped_ratio_loss(rho, advantages, 1.0 - params.seq_eps_low,
                                                    1.0 + params.seq_eps_high)
    return ObjectiveTerms(loss=loss, clip_low=clip_low, clip_high=clip_high, dual_clip=_no_flags(advantages))


@torch.no_grad()
def sequence_log_ratio(
    logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``log s`` of each token's sequence, broadcast to its tokens: the mean of ``logp - behavior_logp`` over the
    sequence's valid tokens (GSPO's length-normalised sequence ratio); 0 on masked tokens. Detached.

    Args:
        logp: [N] current log-probs. behavior_logp: [N] behavior log-probs. loss_mask: [N] bool, True = valid.
        seq_ids / cu_seqlens: the packed layout (exactly one, as in ``aggregate``).

    Returns:
        [N] per-token sequence log-ratio.
    """
    ids, num_seqs = resolve_seq_ids(logp.shape[0], seq_ids, cu_seqlens)
    diff = torch.where(loss_mask, logp - behavior_logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    per_seq = segment_sum(diff, ids, num_seqs) / segment_sum(loss_mask.to(logp.dtype), ids, num_seqs).clamp_min(1)
    return torch.where(loss_mask, per_seq[ids], torch.zeros((), dtype=logp.dtype, device=logp.device))
