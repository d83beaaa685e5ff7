"""Whether a process id still names a live process on this machine."""

from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """True while ``pid`` is a live process here. A zombie counts as dead: it has exited and never acts again. The
    state letter of ``/proc/PID/stat`` follows the command name's closing parenthesis (the name may hold spaces)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # no procfs: os.kill said it exists
        return True
