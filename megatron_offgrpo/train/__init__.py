"""The trainer: builders from the config, the megatron step with the fused loss, the loop, checkpoints, metrics.

The door the commands (``megatron_offgrpo.cli``) enter by. Names load lazily: ``offgrpo train --help`` must not
import megatron-core (5-7 s), and logging is set up before it is imported.
"""

_EXPORTS = {
    "train": "megatron_offgrpo.train.loop",
    "TrainResult": "megatron_offgrpo.train.loop",
    "sft": "megatron_offgrpo.train._sft",
    "evaluate": "megatron_offgrpo.sampler._eval",
    "Rollouts": "megatron_offgrpo.sampler._generate",
    "env_factory": "megatron_offgrpo.sampler._generate",
    "config_or_exit": "megatron_offgrpo.train._preflight",
    "claim_run_dir": "megatron_offgrpo.runlog._run_dir",
    "no_space_line": "megatron_offgrpo.runlog._disk",
    "run_to_exit": "megatron_offgrpo.train._exits",
    "model_dir_errors": "megatron_offgrpo.train._preflight",
    "setup_logging": "megatron_offgrpo.runlog._logs",
    "make_rollout_engine": "megatron_offgrpo.sampler._rollout_side",
    "load_prompts": "megatron_offgrpo.sampler._prompts",
    "load_data": "megatron_offgrpo.sampler._prompts",
    "build_prompts": "megatron_offgrpo.sampler._prompts",
    "log_data": "megatron_offgrpo.sampler._prompts",
    "load_tokenizer": "megatron_offgrpo.sampler._prompts",
    "read_metrics": "megatron_offgrpo.runlog._metrics",
    "RunSummary": "megatron_offgrpo.runlog._summary",
    "run_summary": "megatron_offgrpo.runlog._summary",
    "format_summary": "megatron_offgrpo.runlog._summary",
    "locations": "megatron_offgrpo.runlog._summary",
    "write_summary": "megatron_offgrpo.runlog._summary",
    "eval_points": "megatron_offgrpo.runlog._summary",
    "pass_points": "megatron_offgrpo.runlog._summary",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
