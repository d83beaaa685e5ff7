"""Waiting on an engine process that may die: vLLM's client waits forever for the answer of an engine core that was
killed (its monitor thread shuts the client down, and the waiting call is never woken). Here the call runs in a
thread of its own while this one watches the engine's processes, and a death ends the wait at once."""

from __future__ import annotations

import queue
import signal
import threading
from multiprocessing.process import BaseProcess
from typing import Callable, Sequence, TypeVar

from megatron_offgrpo.rollout._errors import EngineDiedError

T = TypeVar("T")
POLL_S = 0.2  # how often the engine's processes are looked at while a call waits: a death ends it within this


def how_it_ended(process: BaseProcess) -> str:
    """'killed by SIGKILL', 'exit code 1', or 'ended' when the code is not known (another thread reaped it)."""
    code = process.exitcode
    if code is None:
        return "ended"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def dead(processes: Sequence[BaseProcess]) -> BaseProcess | None:
    """The first of ``processes`` that is no longer running, or None."""
    return next((p for p in processes if not p.is_alive()), None)


def call_while_alive(processes: Sequence[BaseProcess], fn: Callable[[], T]) -> T:
    """``fn()``, unless one of ``processes`` dies first (or is dead already).

    Raises:
        EngineDiedError: naming the dead process and how it ended. ``fn``'s thread is left waiting (a daemon: it
            never holds the process's exit up); the engine is unusable from then on.
    """
    if not processes:
        return fn()
    if (gone := dead(processes)) is not None:
        raise EngineDiedError(gone.pid, how_it_ended(gone))
    box: queue.Queue = queue.Queue(maxsize=1)

    def run() -> None:
        try:
            box.put((True, fn()))
        except BaseException as exc:  # handed to the caller's thread, raised there
            box.put((False, exc))

    threading.Thread(target=run, name="offgrpo-engine-call", daemon=True).start()
    while True:
        try:
            ok, value = box.get(timeout=POLL_S)
        except queue.Empty:
            if (gone := dead(processes)) is not None:
                raise EngineDiedError(gone.pid, how_it_ended(gone)) from None
            continue
        if ok:
            return value
        if (gone := dead(processes)) is not None:  # vLLM's own error about the dead engine: say which, and how
            raise EngineDiedError(gone.pid, how_it_ended(gone)) from value
        raise value
