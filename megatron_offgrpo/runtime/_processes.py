"""Whether a process id still names a live process on this machine."""

from __future__ import annotations

import psutil


def process_alive(pid: int) -> bool:
    """True while ``pid`` is a live process here. A zombie counts as dead: it has exited and never acts again."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's process: alive
        return True
