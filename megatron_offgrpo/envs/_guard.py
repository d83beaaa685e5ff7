"""Calling an environment's code (a user's, in this process) with a deadline, and checking what it returns.

Why threads and not a subprocess per environment: an environment is a Python object the user wrote against this
process (it may hold a client, a GPU-free model, a cache shared by its episodes); moving it into a process of its own
would make every ``Observation`` and ``Prompt`` cross a pipe and forbid unpicklable state. A thread cannot be killed,
so a call that never returns is *abandoned*: it runs on a daemon thread, the caller stops waiting at the deadline
and raises ``EnvironmentTimeout`` naming the class, the method and the bound; the process can still exit (nothing
joins a daemon thread; a ``ThreadPoolExecutor`` worker would be joined at exit and hang it). What the abandoned call
holds (a lock, a child process) is only freed by the process ending, which is what the run does next: a demanding
user wants a named error within a known time, not a run that limps on beside a stuck thread.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import threading
import time
from typing import Any, Callable, Sequence

from megatron_offgrpo.envs._protocol import Observation

TIMEOUT_KEY = "env.step_timeout_s"


class EnvironmentTimeout(RuntimeError):
    """An environment's call (make, reset, step, close) did not return within ``env.step_timeout_s``; the message is
    the run's one line."""


class EnvironmentContractError(TypeError):
    """An environment returned what the protocol does not allow (a ``dict`` for an ``Observation``, a reward that is
    not a finite number); the message names the class, the method and the value."""


@dataclasses.dataclass(frozen=True)
class EnvironmentCall:
    """One call of user code: ``fn()``, named ``what`` ("MyEnv.step") in the errors."""

    what: str
    fn: Callable[[], Any]


def bounded_calls(calls: Sequence[EnvironmentCall], timeout_s: float, threads: int = 1) -> list:
    """Each call's result, in order; at most ``threads`` run at once, on daemon threads.

    Raises:
        EnvironmentTimeout: a call ran ``timeout_s`` seconds (from its own start) without returning: it is
            abandoned, and calls not yet started never start.
        Exception: the first failed call's own exception (its traceback kept: it is the user's to read).
    """
    pending, results = collections.deque(range(len(calls))), [None] * len(calls)
    started: dict[int, float] = {}
    state = threading.Condition()
    abandoned = False

    def work() -> None:
        while True:
            with state:
                if abandoned or not pending:
                    return
                i = pending.popleft()
                started[i] = time.monotonic()
            try:
                outcome = (True, calls[i].fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                outcome = (False, exc)
            with state:
                results[i] = outcome
                state.notify_all()

    for k in range(min(max(threads, 1), len(calls))):
        threading.Thread(target=work, name=f"offgrpo-env-{k}", daemon=True).start()
    with state:
        try:
            while (waiting := _waiting(results, started, calls, timeout_s)) is not None:
                state.wait(waiting)  # a timed wait: the main thread's signal handlers still run (SIGTERM sets a flag)
        finally:
            abandoned = True  # (a nonlocal read by the workers under ``state``)
    return [value for _, value in results]


def _waiting(results: list, started: dict[int, float], calls: Sequence[EnvironmentCall],
             timeout_s: float) -> float | None:
    """None when every call returned; else how long to wait for the next event (raising a failure or a timeout)."""
    for outcome in results:
        if outcome is not None and not outcome[0]:
            raise outcome[1]
    running = [i for i, t in started.items() if results[i] is None]
    if not running and all(r is not None for r in results):
        return None
    now = time.monotonic()
    for i in running:
        if now - started[i] >= timeout_s:
            raise EnvironmentTimeout(f"environment {calls[i].what} did not return within {timeout_s:g} s "
                                     f"({TIMEOUT_KEY}): it is left running in a daemon thread and the run stops; fix "
                                     f"the environment, or raise {TIMEOUT_KEY} if it is slow, not stuck")
    deadlines = [started[i] + timeout_s - now for i in running]
    return min([*deadlines, 1.0])


def checked_observation(what: str, obs: object) -> Observation:
    """``obs`` as an ``Observation`` the episode can use (text a str, reward a finite float, done and tool_error
    bools; a numpy scalar is taken as its Python value), else ``EnvironmentContractError`` naming ``what``
    ("MyEnv.step") and the value: a string reward would fail far from the environment, a NaN one poison the
    group's advantages."""
    if not isinstance(obs, Observation):
        raise EnvironmentContractError(f"environment {what} returned {_short(obs)} ({type(obs).__name__}): expected a "
                                       "megatron_offgrpo.envs.Observation(text, role, reward, done, tool_error)")
    problem = _field_problem(obs)
    if problem is not None:
        raise EnvironmentContractError(f"environment {what} returned an Observation with {problem}")
    return dataclasses.replace(obs, reward=float(obs.reward), done=bool(obs.done), tool_error=bool(obs.tool_error))


def _field_problem(obs: Observation) -> str | None:
    reward = obs.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        return f"reward={_short(reward)} ({type(reward).__name__}): expected a finite number (int or float)"
    if not isinstance(obs.text, str):
        return f"text={_short(obs.text)} ({type(obs.text).__name__}): expected a str (the model reads it)"
    for flag in ("done", "tool_error"):
        value = getattr(obs, flag)
        # a numpy / 0-d tensor bool is a flag too; a string ("no") or a number would be read as truthy or not
        if not isinstance(value, bool) and not (getattr(value, "shape", None) == () and
                                                getattr(getattr(value, "dtype", None), "kind", None) == "b"):
            return f"{flag}={_short(value)} ({type(value).__name__}): expected True or False"
    return None


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
