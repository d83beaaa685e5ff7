"""Config sections -> the flat arguments of the components (the only place that reads the config for them)."""

from __future__ import annotations

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.data import SamplingParams


def sampling_params(rollout: RolloutConfig, seed: int | None = None, step: int = 0) -> SamplingParams:
    """How the engine samples step ``step``'s requests. In async mode several steps generate at once: their
    requests are admitted oldest step first (``SamplingParams.priority``), since the trainer takes them in order."""
    return SamplingParams(max_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                          seed=seed, priority=step if rollout.mode == "async" else 0)


def serving_dtype(rollout: RolloutConfig, precision: str) -> str:
    """The dtype an in-process engine generates in: ``rollout.dtype``, whose "auto" follows ``model.precision``
    (fp8 and bf16 runs serve bf16)."""
    if rollout.dtype != "auto":
        return rollout.dtype
    return "float32" if precision == "fp32" else "bfloat16"


def verify_tolerance(rollout: RolloutConfig, precision: str, derived: float | None = None) -> float:
    """Max |fleet - trainer| probe log-prob after a refresh: ``rollout.verify_tolerance`` when set; else, serving
    float32, ``derived`` (``rollout.probe_bound`` of the model, from the trainer) when given; else the
    ``rollout.PROBE_ATOL`` default of the serving dtype (the coarser side decides the agreement)."""
    from megatron_offgrpo.rollout import probe_atol

    if rollout.verify_tolerance is not None:
        return rollout.verify_tolerance
    if derived is not None and serving_dtype(rollout, precision) == "float32":
        return derived
    return probe_atol(serving_dtype(rollout, precision))
