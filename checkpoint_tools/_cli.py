"""Shared CLI plumbing for the conversion commands: flag parsing, logging and clean error reporting.

docs/cli.md promises one line naming the file, tensor, field or flag at fault and exit code 2 on bad input; argparse's
own errors (usage block + message) and multi-line library messages are folded into that one line here.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, NoReturn

from checkpoint_tools._io import CheckpointError
from checkpoint_tools._mapping import UnknownTensorError
from megatron_offgrpo.model import UnsupportedConfigError
from megatron_offgrpo.runtime import tune_cpu_memory


class Parser(argparse.ArgumentParser):
    """``argparse`` whose usage errors are one ``error:`` line (exit 2) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        """Print one line naming the flag and exit 2."""
        fail(f"{message} (--help lists the flags)")


def parallel_size(text: str) -> int:
    """``--tp`` / ``--pp``: an integer >= 1 (0 and negatives are refused here, before any file is read)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a valid parallel size: it must be >= 1")
    return value


def fail(message: object) -> NoReturn:
    """Exit 2 with ``error: MESSAGE`` on one line (continuation lines joined with "; ")."""
    first, *rest = [line.strip() for line in str(message).splitlines() if line.strip()] or [""]
    print(f"error: {first} {'; '.join(rest)}".rstrip(), file=sys.stderr)
    sys.exit(2)


def run_cli(fn: Callable[[], object]) -> None:
    """Run a conversion; user errors print one line naming file/tensor/field and exit 2 (no traceback)."""
    tune_cpu_memory()  # a CLI process, before any tensor work: covers the whole conversion
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        fn()
    # OSError: an unwritable --out or a full disk is the user's to fix; its message names the path
    except (CheckpointError, UnknownTensorError, UnsupportedConfigError, OSError, KeyError, ValueError) as exc:
        fail(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
