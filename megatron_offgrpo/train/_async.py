"""``rollout.mode=async``: the engine generates the next steps' batches in a thread of its own while the trainer
learns, as far ahead as the staleness bound allows, and the trainer takes each step's batch as soon as it is there.

The rule (``rollout.max_staleness`` = B, in optimizer steps): the batch of step ``s`` is started only once the
engine's verified version ``w`` has ``s - w <= B``, so every trained sample is at most B steps stale. Reaching the
bound **pauses** generation until the next refresh; nothing is discarded, and the trainer consumes batches in the
order their prompts were drawn (step order), so a slow, long group is never overtaken by shorter later ones: the
trained data has the generated data's length distribution. (slime's ``train_async`` and NeMo-RL's k-step-off work at
this granularity too; AReaL and PipelineRL go further, with partial rollouts across a refresh: not yet here.)

The engine is one resource: a generation holds ``engine_lock`` for its batch, and the rollout side takes the same lock
to install weights, verify them, evaluate or checkpoint, so those wait for the batch in flight (at most one) and
never interleave with it. A checkpoint keeps the finished, untrained batches (``RolloutState.ready``) with the
prompt stream's position after them: a resumed run trains every prompt of the stream exactly once.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from megatron_offgrpo.train._sampling import RolloutBatch


class AsyncGenerator:
    """Batches of steps ``first, first + 1, ...`` (below ``last``), generated ahead by a thread under the bound."""

    def __init__(self, generate: Callable[[int], RolloutBatch], engine_lock: threading.Lock, bound: int,
                 last: int) -> None:
        self._generate, self.engine_lock = generate, engine_lock
        self._bound, self._last = bound, last
        self._ready: dict[int, RolloutBatch] = {}
        self._cond = threading.Condition()
        self._next: int | None = None  # the next step to generate, set by the first take()
        self._version: int | None = None  # the engine's verified version: generation waits for the first
        self._error: BaseException | None = None
        self._closed = False
        self._paused_s = 0.0  # since the last take(): waiting for the bound (or for the first version)
        self._thread: threading.Thread | None = None

    def set_version(self, version: int) -> None:
        """The engine serves ``version``, verified: generation may run up to ``version + bound``."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def take(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch, waiting for it if it is not ready (the thread starts at the first call).

        Raises:
            whatever the generation raised (a dead engine: ``EngineDiedError``).
        """
        with self._cond:
            if self._thread is None:
                self._next = max([step - 1, *self._ready]) + 1
                self._thread = threading.Thread(target=self._run, name="offgrpo-async-rollout", daemon=True)
                self._thread.start()
            while step not in self._ready and self._error is None:
                self._cond.wait()
            if step not in self._ready:
                raise self._error
            batch = self._ready.pop(step)
            paused, self._paused_s = self._paused_s, 0.0
            depth = len(self._ready)
            self._cond.notify_all()
        batch.timing.update(buffer_depth=depth, fleet_paused_s=paused)
        return batch

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        """A checkpoint's finished, untrained batches (before the first ``take``)."""
        with self._cond:
            self._ready.update(ready)

    def ready_batches(self) -> dict[int, RolloutBatch]:
        """The finished, untrained batches (call with ``engine_lock`` held: then none is in flight, and the stream
        stands right after the last of them)."""
        with self._cond:
            return dict(self._ready)

    def close(self) -> None:
        """Stop after the batch in flight; wait for the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _allowed(self) -> bool:
        return (self._version is not None and self._next < self._last
                and self._next - self._version <= self._bound)

    def _run(self) -> None:
        while True:
            with self._cond:
                start = time.perf_counter()
                while not self._closed and not self._allowed() and self._next < self._last:
                    self._cond.wait()
                self._paused_s += time.perf_counter() - start
                if self._closed or self._next >= self._last:
                    return
                step = self._next
            with self.engine_lock:
                try:
                    batch = self._generate(step)
                except BaseException as exc:  # raised to the trainer by take()
                    with self._cond:
                        self._error = exc
                        self._cond.notify_all()
                    return
                with self._cond:  # still under the engine lock: a checkpoint sees the batch and the stream agree
                    self._ready[step] = batch
                    self._next = step + 1
                    self._cond.notify_all()
