"""Run bookkeeping: the run directory (its rules and lock), the log files, the metrics log and its trackers,
``run_info.json``, the end-of-run summary and what ``offgrpo report`` reads back, a full disk named in one line, and
the checkpoints' layout and discovery (``checkpoints``: the newest complete one, its step, its copy of the log).

The door the trainer (``megatron_offgrpo.train``) and the commands enter by. Names load lazily: ``offgrpo train
--help`` must not import torch (``run_info`` does), and logging is set up before it is imported.
"""

from megatron_offgrpo._lazy import lazy_door

_EXPORTS = {
    "claim_run_dir": "megatron_offgrpo.runlog._run_dir",
    "RunLock": "megatron_offgrpo.runlog._run_dir",
    "setup_logging": "megatron_offgrpo.runlog._logs",
    "writing": "megatron_offgrpo.runlog._disk",
    "no_space_line": "megatron_offgrpo.runlog._disk",
    "MetricsLog": "megatron_offgrpo.runlog._metrics",
    "open_metrics_log": "megatron_offgrpo.runlog._metrics",
    "read_metrics": "megatron_offgrpo.runlog._metrics",
    "missing_trackers": "megatron_offgrpo.runlog._trackers",
    "write_run_info": "megatron_offgrpo.runlog._run_info",
    "run_summary": "megatron_offgrpo.runlog._summary",
    "finish_summary": "megatron_offgrpo.runlog._summary",
    "checkpoints": "megatron_offgrpo.runlog._checkpoints",
    "eval_points": "megatron_offgrpo.runlog._summary",
    "pass_points": "megatron_offgrpo.runlog._summary",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_door(_EXPORTS, whole=("checkpoints",))
