"""``ScoringPool``: requests spread over a scoring fleet's servers, each request failing over to the others.

A scoring fleet (a distillation teacher's prompt log-probs, a reward model's scores, a judge's verdicts) is any
fleet ``offgrpo fleet start`` recorded, of any size and layout. Its requests are independent: request k goes to
server k mod N first (the requests of a step spread over the servers), and a server that fails it (down, a 5xx, a
refused or malformed answer) leaves it to the next one in turn. Servers that were down (``ServerDown``) are asked
last from then on, so a dead server costs each later request nothing while a live one remains; a request is
tried at most once per server, each try bounded by the client's read timeout (``ServerClient``), so a request
ends within N x that timeout, answered or refused with every server's reason.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from megatron_offgrpo.fleet import json_http, load_state, serving
from megatron_offgrpo.rollout._errors import FleetError
from megatron_offgrpo.rollout._server import ServerClient, servers_of

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class ScoringPool:
    """The live servers of a scoring fleet and the threads that send them requests.

    Args:
        servers: the fleet's clients (those that do not answer ``/health`` now are left out).
        what: the fleet's name in messages, e.g. "distill.teacher_fleet" or "reward.fleet".
        requests_at_once: requests in flight at once, over all servers.

    Raises:
        FleetError: no server answers ``/health``.
    """

    def __init__(self, servers: list[ServerClient], what: str, requests_at_once: int = 32) -> None:
        self.what = what
        self.servers = [s for s in servers if s.health()]
        if not self.servers:
            raise FleetError(f"{what}: no server of {[s.name for s in servers]} answers /health: start its fleet "
                             "(offgrpo fleet start --model MODEL --state-dir DIR)")
        self._pool = concurrent.futures.ThreadPoolExecutor(requests_at_once, thread_name_prefix="offgrpo-scoring")
        self._turns = itertools.count()
        self._down: set[str] = set()  # servers that failed with ServerDown: asked last
        self._lock = threading.Lock()

    @classmethod
    def from_state(cls, state: str | Path, what: str, runner: serving.Runner, requests_at_once: int = 32,
                   timeout_s: float | None = None) -> ScoringPool:
        """Connect to the fleet ``offgrpo fleet start`` recorded (its state directory or file), which must serve its
        model with ``runner`` ("generate": a teacher, a judge; "pooling": a sequence classifier); ``timeout_s``
        bounds each request on each server (None: ``ServerClient``'s generation bound).

        Raises:
            ValueError: the fleet runs the other runner (one line naming both).
        """
        recorded = load_state(state)
        if recorded.runner != runner:
            raise ValueError(f"{what}={state}: the fleet serves {recorded.model_dir} with vLLM's {recorded.runner} "
                             f"runner, this needs the {runner} runner (a sequence classifier is served with "
                             "'pooling', a causal LM with 'generate')")
        bounds = {} if timeout_s is None else {"generate_timeout_s": timeout_s}
        return cls(servers_of(recorded, **bounds), what, requests_at_once)

    def map(self, fn: Callable[[ServerClient, T], R], items: Sequence[T],
            labels: Sequence[str] | None = None) -> list[R]:
        """``[fn(server, item) for item in items]``, the items at once, each on the first server that answers it.

        Args:
            fn: one request: raises on a bad answer (any exception: the next server is asked).
            items: the requests' inputs. labels: each item's name in messages (default: its index).

        Raises:
            FleetError: an item that no server answered, with every server's reason.
        """
        names = list(labels) if labels is not None else [str(i) for i in range(len(items))]
        futures = [self._pool.submit(self._first_answer, fn, item, name, next(self._turns))
                   for item, name in zip(items, names)]
        return [future.result() for future in futures]

    def _order(self, turn: int) -> list[ServerClient]:
        """This request's server first, then the others in turn; servers that were down after the live ones."""
        rotated = [self.servers[(turn + k) % len(self.servers)] for k in range(len(self.servers))]
        with self._lock:
            return sorted(rotated, key=lambda s: s.name in self._down)  # stable: the rotation holds within each

    def _first_answer(self, fn: Callable[[ServerClient, T], R], item: T, name: str, turn: int) -> R:
        errors = []
        for server in self._order(turn):
            try:
                answer = fn(server, item)
            except Exception as exc:  # noqa: BLE001 - any failure of one server: the next one answers
                errors.append(f"{server.name}: {type(exc).__name__}: {exc}")
                if isinstance(exc, json_http.ServerDown):
                    with self._lock:
                        self._down.add(server.name)
                continue
            with self._lock:
                self._down.discard(server.name)
            if errors:
                logger.warning("%s: %s; %s answered request %s", self.what, errors[0], server.name, name)
            return answer
        raise FleetError(f"{self.what}: no server answered request {name}: {errors}")

    def close(self) -> None:
        """Stop the threads: the requests not started are dropped, those in flight end within their HTTP timeout
        (the servers belong to ``offgrpo fleet stop``)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
