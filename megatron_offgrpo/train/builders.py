"""Config sections -> the flat arguments of the components (the only place that reads the config for them)."""

from __future__ import annotations

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams
from megatron_offgrpo.config import AlgoConfig, RolloutConfig
from megatron_offgrpo.data import SamplingParams


def objective_params(algo: AlgoConfig, aggregation_constant: float | None = None) -> ObjectiveParams:
    """The loss switches of ``algo``."""
    return ObjectiveParams(
        objective=algo.objective, eps_low=algo.eps_low, eps_high=algo.eps_high, dual_clip=algo.dual_clip,
        rec_weight=algo.rec_weight, rec_clip=algo.rec_clip, tau=algo.tau, kl_estimator=algo.kl_estimator,
        kl_beta=algo.kl_beta, tis_cap=algo.tis_cap, tis_level=algo.tis_level, aggregation=algo.aggregation,
        aggregation_constant=aggregation_constant,
    )


def advantage_params(algo: AlgoConfig) -> AdvantageParams:
    """The advantage-estimator switches of ``algo``."""
    return AdvantageParams(
        form=algo.advantage_form, std_normalize=algo.std_normalize, leave_one_out=algo.leave_one_out,
        gpg_scale=algo.gpg_scale, red_drop=algo.red_drop, mask_zero_variance=algo.mask_zero_variance,
    )


def sampling_params(rollout: RolloutConfig, seed: int | None = None) -> SamplingParams:
    """How the engine samples."""
    return SamplingParams(max_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, seed=seed)
