"""``rollout.mode=async``: the engine generates the next steps' batches while the trainer learns, as far ahead as the
staleness bound allows, and the trainer takes each step's batch as soon as it is there.

The rule (``rollout.max_staleness`` = B, in optimizer steps): the batch of step ``s`` is started only once the
engine's verified version ``w`` has ``s - w <= B``, so every trained sample is at most B steps stale. Reaching the
bound **pauses** generation until the next refresh; nothing is discarded, and the trainer consumes batches in the
order their prompts were drawn (step order), so a slow, long group is never overtaken by shorter later ones: the
trained data has the generated data's length distribution.

Several steps generate at once where the engine shares one batch between callers (``concurrent_generate``: the
in-process vLLM engine, the fleet): every step the bound allows is started, each in a thread of its own, and the
engine's continuous batching gives a slot freed by a short answer to a waiting request instead of idling until the
step's longest answer ends. Which request: the oldest step's. Step s's requests carry priority s
(``SamplingParams.priority``; the engines run vLLM's priority scheduling), since the trainer takes the batches in
step order: with training the slow side, a step after a refresh that shared the batch evenly with the three after it
would end with them, and the trainer would wait for it (docs/benchmarks.md, "Rollout modes", separate cores). Where
the batch has room for every step's requests, all decode at once whatever their priority. Steps draw their first
prompts in step order (a step starts only after the one before it drew), so without dynamic sampling the batches are
the lockstep run's; refill rounds of dynamic sampling draw when they are needed (with their step's priority).

The engine is one resource (``EngineGate``): generations share it; installing weights, verifying them, evaluating
and checkpointing take it alone, after the steps in flight end and before any new one starts. A checkpoint then
keeps the finished, untrained batches (``RolloutState.ready``) with the prompt stream's position after them: a
resumed run trains every prompt of the stream exactly once. (slime's ``train_async`` and NeMo-RL's k-step-off work
at batch granularity with one batch in flight; AReaL and PipelineRL also carry partial rollouts across a refresh:
not yet here.)
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, Sequence

from megatron_offgrpo.sampler._sampling import RolloutBatch

logger = logging.getLogger(__name__)
JOIN_TIMEOUT_S = 60.0
"""How long closing waits for the generation threads, in all. Once the engine is closed a step in flight ends at its
next decode step (the vLLM engine fails its requests); a transformers ``generate`` runs to its end (seconds here)."""

Generate = Callable[[int, Callable[[], None]], RolloutBatch]
"""``generate(step, drawn)``: step ``step``'s scored batch; it calls ``drawn()`` once its first prompts are drawn."""


class EngineGate:
    """Generations share the engine; refresh, verification, evaluation and checkpoints take it alone. A waiting
    exclusive user holds new generations back, so a refresh is never starved by the steps that follow it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._sharing = 0
        self._exclusive = False
        self._exclusive_waiting = 0

    def enter_shared(self) -> None:
        with self._cond:
            while self._exclusive or self._exclusive_waiting:
                self._cond.wait()
            self._sharing += 1

    def leave_shared(self) -> None:
        with self._cond:
            self._sharing -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            while self._exclusive or self._sharing:
                self._cond.wait()
            self._exclusive_waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class AsyncGenerator:
    """Batches of steps ``first, first + 1, ...`` (below ``last``), generated ahead under the bound."""

    def __init__(self, generate: Generate, gate: EngineGate, bound: int, last: int, concurrent: bool) -> None:
        """Args: generate: see ``Generate``. gate: the engine's. bound: B. last: the run's step count.
        concurrent: several steps may generate at once (the engine's ``concurrent_generate``); else one at a time."""
        self._generate, self.gate = generate, gate
        self._bound, self._last, self._most_in_flight = bound, last, (bound + 1 if concurrent else 1)
        self._ready: dict[int, RolloutBatch] = {}
        self._cond = threading.Condition()
        self._next: int | None = None  # the next step to start, set by the first take()
        self._in_flight: set[int] = set()
        self._version: int | None = None  # the engine's verified version: generation waits for the first
        self._errors: dict[int, BaseException] = {}
        self._closed = False
        self._paused_s = 0.0  # since the last take(): no step in flight, held by the bound (or the first version)
        self._thread: threading.Thread | None = None
        self._workers: dict[int, threading.Thread] = {}  # step -> its generation thread (joined by close)

    def set_version(self, version: int) -> None:
        """The engine serves ``version``, verified: generation may run up to ``version + bound``."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch, waiting for it if it is not ready (generation starts at the first call).

        Raises:
            whatever its generation raised (a dead engine: ``EngineDiedError``), or the error that stopped
            generation before this step started.
        """
        with self._cond:
            if self._thread is None:
                self._next = max([step - 1, *self._ready]) + 1
                self._thread = threading.Thread(target=self._dispatch, name="offgrpo-async-rollout", daemon=True)
                self._thread.start()
            while step not in self._ready and not self._failed(step):
                self._cond.wait()
            if step not in self._ready:
                raise self._errors.get(step) or next(iter(self._errors.values()))
            batch = self._ready.pop(step)
            paused, self._paused_s = self._paused_s, 0.0
            depth, in_flight = len(self._ready), len(self._in_flight)
            self._cond.notify_all()
        batch.timing.update(buffer_depth=depth, steps_in_flight=in_flight, fleet_paused_s=paused)
        return batch

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        """A checkpoint's finished, untrained batches (before the first ``take``)."""
        with self._cond:
            self._ready.update(ready)

    def ready_batches(self) -> dict[int, RolloutBatch]:
        """The finished, untrained batches (call inside ``gate.exclusive()``: then none is in flight, and the stream
        stands right after the last of them)."""
        with self._cond:
            return dict(self._ready)

    def stop(self) -> None:
        """Start no more steps (those in flight go on: closing the engine ends them)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self, timeout_s: float = JOIN_TIMEOUT_S) -> list[str]:
        """Start no more steps and join the generation threads (the dispatcher, then each step in flight), at most
        ``timeout_s`` in all; returns the names of those still running then, named in a warning (daemons: they do
        not hold the process's exit up)."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:  # first: once it has returned, it starts no step thread
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._cond:
            threads = [t for t in (self._thread, *self._workers.values()) if t is not None]
        return join_threads(threads, deadline, "the async rollout")

    def _failed(self, step: int) -> bool:
        """Step ``step`` failed, or generation stopped on an error before starting it."""
        return step in self._errors or (bool(self._errors) and step >= self._next)  # >= next: never started

    def _may_start(self) -> bool:
        return (self._version is not None and self._next - self._version <= self._bound
                and len(self._in_flight) < self._most_in_flight)

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._errors or self._next >= self._last or self._may_start()):
                    idle, start = not self._in_flight, time.perf_counter()
                    self._cond.wait()
                    if idle:  # the engine had nothing to generate: held by the bound (or the first version)
                        self._paused_s += time.perf_counter() - start
                if self._closed or self._errors or self._next >= self._last:
                    return
                step = self._next
                self._next += 1
                self._in_flight.add(step)
            self.gate.enter_shared()  # after a refresh or checkpoint that waits: they see no step half-started
            drawn = threading.Event()
            worker = threading.Thread(target=self._work, args=(step, drawn), name=f"offgrpo-rollout-step-{step}",
                                      daemon=True)
            with self._cond:  # the ended ones are forgotten: a long run does not keep a thread object per step
                self._workers = {s: t for s, t in self._workers.items() if t.is_alive()} | {step: worker}
            worker.start()
            drawn.wait()  # the next step draws after this one: batches keep the stream's order

    def _work(self, step: int, drawn: threading.Event) -> None:
        try:
            batch, error = self._generate(step, drawn.set), None
        except BaseException as exc:  # raised to the trainer by take()
            batch, error = None, exc
        drawn.set()
        with self._cond:
            if error is None:
                self._ready[step] = batch
            else:
                self._errors[step] = error
            self._in_flight.discard(step)
            self._cond.notify_all()
        self.gate.leave_shared()  # after the batch is ready: a checkpoint that was waiting keeps it


def join_threads(threads: Sequence[threading.Thread], deadline: float, owner: str) -> list[str]:
    """Join ``threads`` until ``deadline`` (``time.monotonic()``); the names of those still alive then, named in a
    warning with their ``owner``, so that a shutdown never waits without bound nor silently leaves a thread behind."""
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        logger.warning("closing %s: thread(s) %s still running when its wait ran out (JOIN_TIMEOUT_S): left behind",
                       owner, ", ".join(alive))
    return alive
