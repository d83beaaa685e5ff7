"""Config sections -> the flat arguments of the components (the only place that reads the config for them)."""

from __future__ import annotations

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.data import SamplingParams


def sampling_params(rollout: RolloutConfig, seed: int | None = None) -> SamplingParams:
    """How the engine samples."""
    return SamplingParams(max_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                          seed=seed)


def serving_dtype(precision: str) -> str:
    """The dtype an in-process engine serves a policy of ``model.precision`` in (fp8 and bf16 runs serve bf16)."""
    return "float32" if precision == "fp32" else "bfloat16"


def verify_tolerance(rollout: RolloutConfig, precision: str) -> float:
    """Max |fleet - trainer| probe log-prob after a refresh: ``rollout.verify_tolerance`` when set, else the
    ``rollout.PROBE_ATOL`` default of the dtype of ``precision`` (the coarser side decides the agreement)."""
    from megatron_offgrpo.rollout import probe_atol

    return rollout.verify_tolerance if rollout.verify_tolerance is not None else probe_atol(serving_dtype(precision))
