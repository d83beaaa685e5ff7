"""Rank 0's sampling: the engine, the prompt stream and the reward behind ``RolloutSide`` (batch sources: lockstep,
prefetch, async), the run's prompts, evaluation, and the one way prompts become rewarded samples.

The door the trainer (``megatron_offgrpo.train``) and the commands enter by. Names load lazily: ``offgrpo eval
--help`` must not import torch or vLLM, and logging is set up before they are imported.
"""

from megatron_offgrpo._lazy import lazy_door

_EXPORTS = {
    "RolloutSide": "megatron_offgrpo.sampler._rollout_side",
    "RolloutState": "megatron_offgrpo.sampler._sources",
    "make_rollout_engine": "megatron_offgrpo.sampler._rollout_side",
    "sample_metrics": "megatron_offgrpo.sampler._rollout_side",
    "NoLearningSignalError": "megatron_offgrpo.sampler._sampling",
    "Rollouts": "megatron_offgrpo.sampler._generate",
    "ScoreTiming": "megatron_offgrpo.sampler._generate",
    "env_factory": "megatron_offgrpo.sampler._generate",
    "evaluate": "megatron_offgrpo.sampler._eval",
    "load_data": "megatron_offgrpo.sampler._prompts",
    "used_records": "megatron_offgrpo.sampler._prompts",
    "build_prompts": "megatron_offgrpo.sampler._prompts",
    "load_prompts": "megatron_offgrpo.sampler._prompts",
    "log_data": "megatron_offgrpo.sampler._prompts",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_door(_EXPORTS)
