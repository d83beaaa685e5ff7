"""A full disk (or quota) during a run: the write sites name what they were writing, and the commands end with one
line naming it (exit 1) instead of a traceback. What was being written stays under its temporary name (a
checkpoint's ``step_N.tmp``, an export's ``.NAME.tmp-*``), never as a complete-looking one; the next run sweeps it."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import Iterator

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Name ``path`` in an ``OSError`` raised inside the block that names no file (a ``write`` on an open file, a
    library's own error), so the line the command ends with says where the disk filled up."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


def no_space_line(exc: OSError, out_dir: str) -> str | None:
    """The one line a full disk ends a run with (the path being written and what to do), or None for any other
    ``OSError``."""
    if exc.errno not in NO_SPACE:
        return None
    return (f"error: {exc.filename or out_dir}: no space left on device (errno {exc.errno}): free space there, then "
            "continue with --resume from the newest complete checkpoint")
