"""Where the log lines of ``offgrpo train`` / ``offgrpo sft`` go: everything to ``RUN/train.log``, little to the
console.

A run's console should show its progress line, what it did that a user acts on (run started, checkpoint saved,
resumed from, policy exported) and real warnings. megatron-core logs its config dumps and bucket layouts at INFO,
warns at import that Transformer Engine and Apex are absent (expected on CPU), and an in-process vLLM engine logs
INFO lines and warnings about its own setup (no tcmalloc, eager mode, layers without weights) at every start and
refresh; all of that goes to the run's log file only. ``--verbose`` brings it back to the console.
vLLM configures its own loggers (they do not propagate to the root), in this process and in any
engine-core process it spawns, from the JSON file named by ``VLLM_LOGGING_CONFIG_PATH``: we write one into the run
directory that sends them to the same file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from pathlib import Path

LOG_FILE = "train.log"
VLLM_CONFIG_FILE = ".vllm_logging.json"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
QUIET_LOGGERS = ("megatron_offgrpo.runtime", "megatron_offgrpo.rollout._verify", "megatron_offgrpo.train._sync")
"""Our own INFO lines that are details, not events: the CPU compatibility layer and the parallel layout at start,
and two lines per weight refresh (its time is in the progress line; a failed refresh raises or warns)."""
EXPECTED_WARNINGS = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                     "full scope is deprecated")
"""Warnings megatron-core gives every run without Transformer Engine and apex (any CPU run), and one its own
default config triggers: nothing a user can act on, so the log file keeps them and the console does not."""
LIBRARY_DEPRECATION = re.compile(r"site-packages/\S+: (?:Deprecation|PendingDeprecation|Future)Warning:")
"""A library's own use of something deprecated (vLLM calling ``torch.distributed.reduce_op``): only it can fix it."""
VLLM_CONSOLE_LEVEL = "ERROR"
"""vLLM's warnings on the quiet console: none. An in-process engine's are about vLLM's own setup (they repeat at each
refresh); a failure of ours raises, and the file keeps them all."""


@dataclasses.dataclass(frozen=True)
class RunLogs:
    """Where this process logs. path: the log file. verbose: the console shows every INFO line."""

    path: Path
    verbose: bool


class ConsoleFilter(logging.Filter):
    """The quiet console: warnings and errors (except ``EXPECTED_WARNINGS`` and libraries' deprecations), and our own
    INFO lines (except ``QUIET_LOGGERS``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            message = record.getMessage()
            return not (any(text in message for text in EXPECTED_WARNINGS) or LIBRARY_DEPRECATION.search(message))
        # before vLLM configures its loggers, they propagate
        if record.name == "vllm" or record.name.startswith("vllm."):
            return record.levelno >= getattr(logging, VLLM_CONSOLE_LEVEL)
        if record.levelno >= logging.WARNING:
            return True
        return record.name.startswith("megatron_offgrpo") and not record.name.startswith(QUIET_LOGGERS)


def setup_logging(run_dir: str | Path, verbose: bool = False) -> RunLogs:
    """Send every log line of this process to ``run_dir/train.log`` and the console's share to stderr.

    Call it once, at the entry point, before megatron-core, transformers or vLLM are imported (their import-time
    warnings and progress bars are decided then). Under torchrun every rank calls it: ranks above 0 add their rank
    to each line of the shared file, and show only warnings on the console unless ``verbose``.

    Returns:
        Where the log goes.
    """
    rank = int(os.environ.get("RANK", "0") or 0)
    path = Path(run_dir) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = FORMAT if rank == 0 else f"[rank {rank}] {FORMAT}"
    file_handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(fmt))
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(fmt))
    if not verbose:
        console.addFilter(ConsoleFilter())
        if rank > 0:
            console.setLevel(logging.WARNING)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Loading weights" bars
        if "transformers.utils.logging" in sys.modules:  # imported already (a preflight read a tokenizer): it read
            sys.modules["transformers.utils.logging"].disable_progress_bar()  # the variable then
    logging.basicConfig(level=logging.INFO, handlers=[file_handler, console], force=True)
    logging.captureWarnings(True)  # warnings.warn -> "py.warnings": into the file, filtered on the console
    _route_vllm(path, fmt, verbose)
    return RunLogs(path=path, verbose=verbose)


def vllm_logging_config(path: Path, fmt: str, verbose: bool, level: str = "INFO") -> dict:
    """vLLM's logging dictConfig: its loggers to ``path`` at ``level``, and to stderr at ``VLLM_CONSOLE_LEVEL``
    (``verbose``: at ``level``)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"offgrpo": {"format": fmt}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(path), "mode": "a", "encoding": "utf-8",
                     "formatter": "offgrpo", "level": level},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "offgrpo",
                        "level": level if verbose else VLLM_CONSOLE_LEVEL},
        },
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": level, "propagate": False}},
    }


def _route_vllm(path: Path, fmt: str, verbose: bool) -> None:
    # A user's own vLLM logging setup wins: VLLM_CONFIGURE_LOGGING=0 or a config file of their own.
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    config = path.parent / VLLM_CONFIG_FILE
    config.write_text(json.dumps(vllm_logging_config(path, fmt, verbose, os.environ.get("VLLM_LOGGING_LEVEL", "INFO")),
                                 indent=1))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config)  # read when vllm is imported, here and in its subprocesses
