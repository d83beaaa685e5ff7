"""Frozen switch sets for advantages and objectives, validated on construction.

Both dataclasses check every field in ``validate()`` (called by ``__post_init__``) and raise one
``ValueError`` that lists every broken field with its value, the rule and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_offgrpo.algo._registry import objective_names

ADVANTAGE_FORMS = ("sqrt_var", "std_eps")
REC_WEIGHTS = ("none", "is")
REC_CLIPS = ("none", "one_side", "two_side", "ring")
KL_ESTIMATORS = ("k1", "k2", "k3")
TIS_LEVELS = ("token", "sequence")
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "token_sum_norm")
_TAU_OBJECTIVES = ("opmd", "asymre")


def _choice(errors: list[str], name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        errors.append(f"{name}={value!r} is not one of {valid}; pick one of them")


def _require(errors: list[str], name: str, value: object, rule: str, ok: bool) -> None:
    if not ok:
        errors.append(f"{name}={value!r} breaks the rule '{rule}'; set {name} to a finite number {rule}")


def _num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _raise(cls_name: str, errors: list[str]) -> None:
    if errors:
        raise ValueError(f"invalid {cls_name} ({len(errors)} error(s)):\n  - " + "\n  - ".join(errors))


@dataclass(frozen=True)
class AdvantageParams:
    """Switches of the group-relative advantage estimator (see ``compute_group_advantages``)."""

    form: Literal["sqrt_var", "std_eps"] = "sqrt_var"
    """``"sqrt_var"``: the seed paper's ``(r - mean) / sqrt(var + eps)`` with the POPULATION variance
    (divide by G; Mroueh et al., "Revisiting GRPO"). ``"std_eps"``: the common ``(r - mean) / (std + eps)``
    with the UNBIASED (Bessel, divide by G - 1) std, as in DeepSeekMath GRPO / TRL ``GRPOTrainer``."""
    eps: float = 1e-6
    """Stabiliser in the denominator; must be >= 0."""
    std_normalize: bool = True
    """Divide by the group spread. False = Dr.GRPO (mean-centred rewards only)."""
    leave_one_out: bool = False
    """Baseline of sample i = mean of the OTHER kept samples of its group (RLOO); equals
    ``k / (k - 1) * (r_i - mean)`` with k kept samples. The denominator (if any) is the same group statistic."""
    gpg_scale: bool = False
    """GPG: multiply all advantages by ``B / max(1, #valid)``; B = groups passed in, #valid = groups whose
    rewards are not all equal."""
    red_drop: bool = False
    """RED-Drop (Yao et al.): in each group drop surplus negatives (``r < mean``) until negatives <= positives,
    then recompute mean/spread over the kept samples. Dropped samples get ``sample_valid = False``."""
    mask_zero_variance: bool = True
    """A group whose rewards are all equal gets ``sample_valid = False`` (its tokens leave the loss and its
    normaliser). False = plain GRPO: such groups keep advantage 0 but stay in the normaliser."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field; raises one ``ValueError`` listing all broken fields."""
        errors: list[str] = []
        _choice(errors, "form", self.form, ADVANTAGE_FORMS)
        _require(errors, "eps", self.eps, ">= 0", _num(self.eps) and self.eps >= 0)
        for name in ("std_normalize", "leave_one_out", "gpg_scale", "red_drop", "mask_zero_variance"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name}={getattr(self, name)!r} must be a bool; set True or False")
        _raise(type(self).__name__, errors)


@dataclass(frozen=True)
class ObjectiveParams:
    """Switches of the per-token loss, the KL term, truncated IS and the aggregation."""

    objective: str = "grpo_clip"
    """Registry name: ``grpo_clip`` (PPO-style clipped ratio, on- or off-policy), ``gpg`` (``-A logp``),
    ``rec`` (REC family: ``-w A logp m``), ``opmd`` (REC + ``tau (logp - logp_b)^2``),
    ``asymre`` (REC + ``-tau logp``), ``cispo`` (``-sg(clip(rho)) A logp``), ``gspo`` (clipped sequence ratio)."""
    eps_low: float = 0.2
    """Lower trust-region width: ratio floor ``1 - eps_low``; in [0, 1]."""
    eps_high: float = 0.2
    """Upper trust-region width: ratio ceiling ``1 + eps_high``; >= 0."""
    seq_eps_low: float = 3e-4
    """``gspo``: floor ``1 - seq_eps_low`` of the sequence ratio; in [0, 1]. The GSPO paper's 3e-4: a
    length-normalised sequence ratio moves far less than a token's."""
    seq_eps_high: float = 4e-4
    """``gspo``: ceiling ``1 + seq_eps_high`` of the sequence ratio; >= 0 (the paper's 4e-4)."""
    dual_clip: Optional[float] = None
    """Dual-clip constant c > 1 (Ye et al. 2020), ``grpo_clip`` only: for A < 0 the loss is at most ``-c A``."""
    rec_weight: Literal["none", "is"] = "none"
    """REC token weight w: ``"none"`` = 1 (NoIS), ``"is"`` = ``rho.detach()`` (IS)."""
    rec_clip: Literal["none", "one_side", "two_side", "ring"] = "none"
    """REC token mask m (see ``_objectives.rec_keep_mask``)."""
    eps_low_outer: float = 0.6
    """Ring clip: for A >= 0, tokens with ``rho <= 1 - eps_low_outer`` are kept again; in [eps_low, 1]."""
    eps_high_outer: float = 2.0
    """Ring clip: for A <= 0, tokens with ``rho >= 1 + eps_high_outer`` are kept again; >= eps_high."""
    tau: float = 0.0
    """Regulariser strength of ``opmd`` / ``asymre``; >= 0; must be 0 for other objectives."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL(pi_theta || pi_ref) per-token estimator (Schulman's k1/k2/k3)."""
    kl_beta: float = 0.0
    """KL coefficient; >= 0; > 0 needs ``ref_logp``."""
    tis_cap: Optional[float] = None
    """Truncated-IS cap C > 0 on ``exp(logp_trainer_old - logp_fleet)``; None = no correction."""
    tis_level: Literal["token", "sequence"] = "token"
    """Truncated IS per token, or per sequence (exp of the summed log-ratio of the sequence)."""
    aggregation: Literal["token_mean", "seq_mean_token_mean", "token_sum_norm"] = "token_mean"
    """How per-token losses become one scalar (see ``aggregate``)."""
    aggregation_constant: Optional[float] = None
    """Divisor of ``token_sum_norm`` (> 0, required there; ignored by the other modes)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def sequence_ratio(self) -> bool:
        """The objective needs each token's ``sequence_log_ratio`` (a reduction over its whole sequence)."""
        return self.objective == "gspo"

    def validate(self) -> None:
        """Checks every field and cross-field rule; raises one ``ValueError`` listing all broken fields."""
        errors: list[str] = []
        _choice(errors, "objective", self.objective, objective_names())
        _require(errors, "eps_low", self.eps_low, "in [0, 1]", _num(self.eps_low) and 0 <= self.eps_low <= 1)
        _require(errors, "eps_high", self.eps_high, ">= 0", _num(self.eps_high) and self.eps_high >= 0)
        ok = _num(self.seq_eps_low) and 0 <= self.seq_eps_low <= 1
        _require(errors, "seq_eps_low", self.seq_eps_low, "in [0, 1]", ok)
        _require(errors, "seq_eps_high", self.seq_eps_high, ">= 0", _num(self.seq_eps_high) and self.seq_eps_high >= 0)
        if self.sequence_ratio and self.aggregation != "seq_mean_token_mean":
            errors.append(
                f"objective={self.objective!r} is a sequence-level objective (the mean over sequences of their "
                f"clipped ratio terms), but aggregation={self.aggregation!r} weights sequences by length; "
                "set aggregation='seq_mean_token_mean'"
            )
        if self.dual_clip is not None:
            ok = _num(self.dual_clip) and self.dual_clip > 1
            _require(errors, "dual_clip", self.dual_clip, "> 1 (or None)", ok)
            if self.objective != "grpo_clip":
                errors.append(
                    f"dual_clip={self.dual_clip!r} is only used by objective='grpo_clip', "
                    f"not objective={self.objective!r}; set dual_clip=None"
                )
        _choice(errors, "rec_weight", self.rec_weight, REC_WEIGHTS)
        _choice(errors, "rec_clip", self.rec_clip, REC_CLIPS)
        ring = self.rec_clip == "ring"  # the outer widths mean nothing elsewhere (e.g. cispo with eps_low = 1)
        if ring and _num(self.eps_low) and 0 <= self.eps_low <= 1:
            ok = _num(self.eps_low_outer) and self.eps_low <= self.eps_low_outer <= 1
            _require(errors, "eps_low_outer", self.eps_low_outer, f"in [eps_low={self.eps_low}, 1]", ok)
        if ring and _num(self.eps_high) and self.eps_high >= 0:
            ok = _num(self.eps_high_outer) and self.eps_high_outer >= self.eps_high
            _require(errors, "eps_high_outer", self.eps_high_outer, f">= eps_high={self.eps_high}", ok)
        _require(errors, "tau", self.tau, ">= 0", _num(self.tau) and self.tau >= 0)
        if _num(self.tau) and self.tau != 0 and self.objective not in _TAU_OBJECTIVES:
            errors.append(
                f"tau={self.tau!r} is only used by objective in {_TAU_OBJECTIVES}, "
                f"not objective={self.objective!r}; set tau=0.0 or pick one of them"
            )
        _choice(errors, "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _require(errors, "kl_beta", self.kl_beta, ">= 0", _num(self.kl_beta) and self.kl_beta >= 0)
        if self.tis_cap is not None:
            _require(errors, "tis_cap", self.tis_cap, "> 0 (or None)", _num(self.tis_cap) and self.tis_cap > 0)
        _choice(errors, "tis_level", self.tis_level, TIS_LEVELS)
        _choice(errors, "aggregation", self.aggregation, AGGREGATIONS)
        c = self.aggregation_constant
        if c is None and self.aggregation == "token_sum_norm":
            errors.append(
                "aggregation_constant=None, but aggregation='token_sum_norm' divides the token sum by it; "
                "set aggregation_constant (e.g. the max response length)"
            )
        elif c is not None:
            _require(errors, "aggregation_constant", c, "> 0", _num(c) and c > 0)  # type: ignore[operator]
        _raise(type(self).__name__, errors)

