"""Per-token estimators of KL(pi_theta || pi_ref) (Schulman, "Approximating KL divergence", 2020).

With ``d = logp_ref - logp`` (log-prob of the sampled token under the reference minus the current policy):

    k1 = -d = logp - logp_ref                (unbiased, high variance, can be negative)
    k2 = 0.5 * d^2                          (biased, low variance, >= 0)
    k3 = exp(d) - d - 1                     (unbiased, low variance, >= 0; "low_var_kl" in verl)

Only k3 exponentiates; there ``d`` is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] so it never overflows
(the same guard as verl's ``kl_penalty``). k1 and k2 are exact.

Shape notation: N = tokens flattened over the packed batch.
"""

from __future__ import annotations

import torch

from megatron_offgrpo.algo._params import KL_ESTIMATORS

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before ``exp`` (ratio in [2e-9, 5e8]); gradient is 0 beyond (as in verl)."""


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate, differentiable w.r.t. ``logp``.

    Args:
        logp: [N] log-prob of each sampled token under the current policy.
        ref_logp: [N] log-prob of the same token under the reference policy (treated as a constant).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.

    Returns:
        [N] the estimate per token.

    Raises:
        ValueError: if ``estimator`` is not one of the names above.
    """
    d = ref_logp.detach() - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(d) - d - 1
    raise ValueError(f"kl_estimator={estimator!r} is not one of {KL_ESTIMATORS}; pick one of them")
