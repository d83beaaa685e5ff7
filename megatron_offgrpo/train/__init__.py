"""The trainer: the loop over the trainer side (every rank: policy, optimizer, reference, teacher) and rank 0's
sampler (``megatron_offgrpo.sampler``), the megatron step with the fused loss, checkpoints, HF exports, the warm-up.

The door the commands (``megatron_offgrpo.cli``) and the benchmarks enter by. Names load lazily: ``offgrpo train
--help`` must not import megatron-core (5-7 s), and logging is set up before it is imported.
"""

from megatron_offgrpo._lazy import lazy_door

_EXPORTS = {
    "DeltaSender": "megatron_offgrpo.train._delta_sync",  # rollout.sync=delta's encoder (tests, the benchmark)
    "train": "megatron_offgrpo.train.loop",
    "sft": "megatron_offgrpo.train._sft",
    "run_to_exit": "megatron_offgrpo.train._exits",
    # the pieces of the step, for the benchmarks that time them
    "build_policy": "megatron_offgrpo.train._policy",
    "use_fused_adam": "megatron_offgrpo.train._policy",
    "build_microbatches": "megatron_offgrpo.train._batch",
    "build_packed_microbatches": "megatron_offgrpo.train._packing",
    "build_shared_prompt_microbatches": "megatron_offgrpo.train._shared_prompt",
    "global_token_count": "megatron_offgrpo.train._batch",
    "global_seq_count": "megatron_offgrpo.train._batch",
    "policy_step": "megatron_offgrpo.train._step",
    "token_logprobs": "megatron_offgrpo.train._step",
    "export_buckets": "megatron_offgrpo.train._weights",
    "checkpoint": "megatron_offgrpo.train._checkpoint",  # save_checkpoint, TrainerState: the async-save benchmark
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_door(_EXPORTS, whole=("checkpoint",))
