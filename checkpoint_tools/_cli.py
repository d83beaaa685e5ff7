"""Shared CLI plumbing for the conversion commands: logging and clean error reporting."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from checkpoint_tools._io import CheckpointError
from checkpoint_tools._mapping import UnknownTensorError
from megatron_offgrpo.model._arch import UnsupportedConfigError
from megatron_offgrpo.runtime import use_huge_pages


def run_cli(fn: Callable[[], object]) -> None:
    """Run a conversion; user errors print one line naming file/tensor/field and exit 2 (no traceback)."""
    use_huge_pages()  # a CLI process, before any tensor work: covers the whole conversion
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        fn()
    except (CheckpointError, UnknownTensorError, UnsupportedConfigError, FileExistsError, FileNotFoundError,
            KeyError, ValueError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)
