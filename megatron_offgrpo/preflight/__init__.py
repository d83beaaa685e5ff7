"""Preflight: every check that can run before a process group, a model or an engine exists (the recipe, the
overrides, the model directories, the data, the layout against the job's processes, a teacher). A command that fails
here prints one line per error and exits 2, having written nothing. It runs once per command, before the trainer's
ranks exist, so it is a room of its own, not part of train/.
"""

from megatron_offgrpo.preflight._checks import config_or_exit, model_dir_errors, teacher_errors

__all__ = ["config_or_exit", "model_dir_errors", "teacher_errors"]
