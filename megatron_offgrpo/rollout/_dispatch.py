"""Spreading groups over servers: least-loaded choice, retries with backoff and jitter, failover, no duplicates.

Each group is one task. A task takes the least-loaded live server, sends the whole group, and on a failure waits
(exponential backoff with jitter) and tries again, preferring servers it has not failed on. A server that fails
``dead_after`` times in a row is marked dead and gets no more work. Its in-flight groups fail on their own when the
server's connections reset (a killed process); a server that holds them without a word (frozen, or its node gone
without a reset) is found by ``HealthWatch``, whose failed checks mark it dead: the requests waiting on it are given
up then (``unless_given_up``, which a fleet's ``ServerClient`` runs every call through) and the tasks resend the
groups elsewhere, instead of waiting out a generation's read timeout. Results are stored by group index, each
exactly once, so the output has every group once whatever happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Iterator, TypeVar

from megatron_offgrpo.fleet import json_http
from megatron_offgrpo.rollout._errors import FleetError
from megatron_offgrpo.rollout._samples import BadResponse

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How hard the client tries before giving up.

    Attributes:
        max_attempts: tries per group, over all servers. dead_after: consecutive failures that mark a server dead.
        backoff_s: wait before the first retry; doubles per attempt up to max_backoff_s, times a random factor
            in [1 - jitter, 1 + jitter]. max_inflight_per_server: concurrent groups per server.
        health_every_s: seconds between two ``/health`` checks of each serving server (``HealthWatch``).
        health_timeout_s: a check unanswered this long fails; ``dead_after`` failed checks in a row mark the server
            dead. A live server answers in milliseconds, even while it decodes (a GPU server's engine runs in a
            process of its own); on a loaded CPU one, the event loop shares the core with the engine, hence seconds.
    """

    max_attempts: int = 6
    dead_after: int = 2
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    jitter: float = 0.5
    max_inflight_per_server: int = 8
    health_every_s: float = 2.0
    health_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for key in ("max_attempts", "dead_after", "max_inflight_per_server"):
            if getattr(self, key) < 1:
                raise ValueError(f"RetryPolicy.{key}={getattr(self, key)} must be >= 1")
        for key in ("health_every_s", "health_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"RetryPolicy.{key}={getattr(self, key)} must be > 0")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


class ServerPool:
    """Thread-safe state of the servers: in-flight counts, consecutive failures, dead or out of rotation."""

    def __init__(self, names: list[str], dead_after: int) -> None:
        """Args: names: server names. dead_after: consecutive failures that mark a server dead."""
        self._lock = threading.Lock()
        self._inflight = {n: 0 for n in names}
        self._failures = {n: 0 for n in names}
        self.dead: dict[str, str] = {}
        self.benched: dict[str, str] = {}
        self.retries = 0  # requests that failed and were sent again (for logs and tests)
        self._dead_after = dead_after

    def serving(self) -> list[str]:
        """Servers that take work: alive and in rotation."""
        with self._lock:
            return [n for n in self._inflight if n not in self.dead and n not in self.benched]

    def acquire(self, avoid: set[str]) -> str | None:
        """The least-loaded serving server, preferring those not in ``avoid``; None when none serves."""
        with self._lock:
            live = [n for n in self._inflight if n not in self.dead and n not in self.benched]
            if not live:
                return None
            preferred = [n for n in live if n not in avoid] or live
            name = min(preferred, key=lambda n: (self._inflight[n], self._failures[n]))
            self._inflight[name] += 1
            return name

    def release(self, name: str, error: str | None = None, retry: bool = False) -> None:
        """End one request on ``name``; ``error`` (a server-side failure) counts towards marking it dead;
        ``retry``: the request failed and will be sent again."""
        with self._lock:
            self._inflight[name] -= 1
            if retry:
                self.retries += 1
            if error is None:
                self._failures[name] = 0
                return
            self._failures[name] += 1
            if self._failures[name] < self._dead_after:
                return
        self.mark_dead(name, f"{self._failures[name]} consecutive failures: {error}")

    def mark_dead(self, name: str, reason: str) -> None:
        """``name`` gets no more work, and the tasks waiting on its answers give up their requests."""
        with self._lock:
            if name in self.dead:
                return
            self.dead[name] = reason
        logger.warning("server %s marked dead: %s", name, reason)

    def why_dead(self, name: str) -> str | None:
        """Why ``name`` is dead, or None while it is not (the calls waiting on it give up once it says why)."""
        with self._lock:
            return self.dead.get(name)

    def alive(self) -> list[str]:
        """Servers not marked dead: serving, or out of rotation until a refresh repairs them."""
        with self._lock:
            return [n for n in self._inflight if n not in self.dead]

    def bench(self, name: str, reason: str) -> None:
        """Take ``name`` out of rotation (e.g. a failed refresh) until ``restore``."""
        with self._lock:
            self.benched[name] = reason

    def restore(self, name: str) -> None:
        """Put ``name`` back: alive, in rotation, failure count reset."""
        with self._lock:
            self.benched.pop(name, None)
            self.dead.pop(name, None)
            self._failures[name] = 0


def _run_one(pool: ServerPool, policy: RetryPolicy, send: Callable[[str, int], T], index: int) -> T:
    errors: list[str] = []
    tried: set[str] = set()
    for attempt in range(1, policy.max_attempts + 1):
        name = pool.acquire(tried)
        if name is None:
            break
        try:
            result = send(name, index)
        except json_http.RequestRejected as exc:  # the request itself is wrong: no other server will accept it
            pool.release(name)
            raise FleetError(f"group {index} rejected by server {name}: {exc}") from None
        except (json_http.ServerDown, BadResponse) as exc:
            down = isinstance(exc, json_http.ServerDown)
            pool.release(name, str(exc) if down else None, retry=True)
            errors.append(f"attempt {attempt} on {name}: {exc}")
            tried.add(name)
            time.sleep(policy.delay(attempt))
            continue
        pool.release(name)
        return result
    raise FleetError(
        f"group {index} failed on every attempt (dead servers: {sorted(pool.dead) or 'none'}):\n  "
        + "\n  ".join(errors or ["no serving server"])
    )


def unless_given_up(given_up: Callable[[], str | None], call: Callable[[], T]) -> T:
    """``call()`` (a request to one server), run in a thread of its own so that it is given up, ``ServerDown``, as
    soon as ``given_up()`` says why (``ServerPool.why_dead``: the server was marked dead, e.g. by its health checks):
    a frozen server would otherwise hold the caller until the request's read timeout, minutes. The abandoned request
    ends with the server's read timeout or connection; its answer, if one ever comes, is dropped (a group is resent
    elsewhere, never produced twice; a refresh counts the server as failed)."""
    if (reason := given_up()) is not None:
        raise json_http.ServerDown(f"server given up ({reason}): request not sent")
    answer: Future = Future()

    def run() -> None:
        try:
            answer.set_result(call())
        except BaseException as exc:  # raised in the caller's thread below
            answer.set_exception(exc)

    threading.Thread(target=run, name="offgrpo-request", daemon=True).start()
    while True:
        try:
            return answer.result(timeout=0.25)
        except FutureTimeout:
            if (reason := given_up()) is not None:
                raise json_http.ServerDown(f"server marked dead with this request in flight ({reason}): request "
                                           "given up") from None


class HealthWatch:
    """While generations or a refresh are in flight (``watching``), checks every live server's ``/health`` every
    ``policy.health_every_s``; ``policy.dead_after`` failed checks in a row mark it dead, and the requests in flight on
    it are given up (``unless_given_up``): groups are resent elsewhere, a refresh goes on without it.

    Why: a killed server resets its connections and its requests fail at once, but a frozen one (SIGSTOP, a hung
    driver) or one whose node vanished without a reset holds them until the generation's read timeout, minutes.
    """

    def __init__(self, pool: ServerPool, check: Callable[[str, float], None], policy: RetryPolicy) -> None:
        """Args: pool: the servers. check: ``check(name, timeout_s)`` raises when ``name`` is not healthy."""
        self._pool, self._check, self._policy = pool, check, policy
        self._lock = threading.Lock()
        self._watchers = 0
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Checks run from the first caller's entry to the last one's exit (generations from several threads, a
        refresh from the trainer's)."""
        with self._lock:
            self._watchers += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="offgrpo-fleet-health", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._watchers -= 1

    def _run(self) -> None:
        failed: dict[str, int] = {}
        while True:
            time.sleep(self._policy.health_every_s)
            with self._lock:
                if not self._watchers:
                    self._thread = None
                    return
            for name in self._pool.alive():  # out of rotation too: a refresh waits on it
                try:
                    self._check(name, self._policy.health_timeout_s)
                    failed[name] = 0
                except Exception as exc:  # any failure to answer counts
                    failed[name] = failed.get(name, 0) + 1
                    if failed[name] >= self._policy.dead_after:
                        failed[name] = 0
                        self._pool.mark_dead(name, f"{self._policy.dead_after} health checks in a row failed "
                                                   f"(last: {exc})")


def run_groups(pool: ServerPool, policy: RetryPolicy, count: int, send: Callable[[str, int], T]) -> list[T]:
    """Run ``send(server, index)`` for indices 0..count-1 with retries and failover; results in index order.
    ``send`` raises ``ServerDown`` once its server is marked dead with the request in flight (``unless_given_up``).

    Raises:
        FleetError: a group failed on all attempts, was rejected (4xx), or no server serves.
    """
    if count == 0:
        return []
    if not pool.serving():
        raise FleetError(f"no serving server (dead: {pool.dead}, out of rotation: {pool.benched})")
    results: dict[int, T] = {}
    workers = max(1, min(count, len(pool.serving()) * policy.max_inflight_per_server))
    executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="offgrpo-group")
    try:
        futures = {executor.submit(_run_one, pool, policy, send, i): i for i in range(count)}
        for future, index in futures.items():
            result = future.result()
            assert index not in results, f"group {index} produced twice"
            results[index] = result
    finally:
        executor.shutdown(wait=True, cancel_futures=True)
    return [results[i] for i in range(count)]
