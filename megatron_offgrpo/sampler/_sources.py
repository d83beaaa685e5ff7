"""Which batch a step trains, and when it was generated: one ``BatchSource`` per ``rollout.mode``, chosen once
(``make_source``), so that nothing downstream asks which mode runs.

- ``LockstepSource`` (lockstep): the step's batch is generated when the step asks for it.
- ``PrefetchSource`` (overlap): step k+1's batch generates in a thread of its own while the trainer learns from
  step k's; the loop collects it, refreshes, and starts the next (``start``).
- ``AsyncSource`` (async, async_partial): ``sampler._async``'s generator runs ahead under the staleness bound; the
  engine's ``EngineGate`` orders its generations against refreshes, evaluation and checkpoints.

Every source keeps what a checkpoint needs (``RolloutState``): the batches generated but not trained, and the
stream's position right after them, so that a resumed run trains every prompt of the stream exactly once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from typing import ContextManager, Protocol

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.sampler._async import AsyncGenerator, EngineGate
from megatron_offgrpo.sampler._maker import BatchMaker
from megatron_offgrpo.sampler._sampling import RolloutBatch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RolloutState:
    """What a checkpoint keeps of the rollout side (``rollout_state.pt`` in the checkpoint).

    Attributes:
        stream: the prompt stream's position, right after the last prompt drawn for a batch in ``ready``.
        ready: step -> its batch, generated and scored but not trained yet (overlap's prefetch, the async modes'
            buffer): a resumed run trains them as the uninterrupted one would, and draws its next prompts after
            them, so every prompt of the stream is trained exactly once.
    """

    stream: dict[str, int]
    ready: dict[int, RolloutBatch] = dataclasses.field(default_factory=dict)


class BatchSource(Protocol):
    """Where a step's batch comes from (rank 0). The loop calls, per step: ``next_batch(step)``, the refresh if one
    is due (``refresh_access`` held around it, ``verified`` after it), then ``start(step + 1)``."""

    def next_batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch (a checkpoint's ready one first), waiting for it if it is generating."""

    def start(self, step: int) -> None:
        """This step's refresh is done: a source that generates ahead starts step ``step``'s batch now."""

    def verified(self, version: int) -> None:
        """The engine serves ``version``, verified."""

    def refresh_access(self) -> ContextManager[None]:
        """What installing and verifying weights holds against this source's generation."""

    def exclusive(self) -> ContextManager[None]:
        """The engine alone (evaluation): no generation of this source starts inside."""

    def resume_state(self) -> RolloutState:
        """The batches generated and not trained, and the stream after them (those in flight are waited for)."""

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        """A checkpoint's ready batches (before the first ``next_batch``)."""

    def stop(self) -> None:
        """Start no more generation (closing the engine ends the one in flight)."""

    def join(self, deadline: float) -> None:
        """Join this source's threads until ``deadline`` (``time.monotonic()``), naming any left in a warning."""


def make_source(r: RolloutConfig, maker: BatchMaker, last: int, concurrent: bool) -> BatchSource:
    """``rollout.mode``'s source. ``last``: the run's step count (nothing is generated past it). ``concurrent``:
    the engine shares one batch between callers (``RolloutEngine.concurrent_generate``)."""
    if r.mode == "lockstep":
        return LockstepSource(maker)
    if r.mode == "overlap":
        return PrefetchSource(maker, last)
    return AsyncSource(maker, r.staleness_bound(), last, concurrent, partial=r.mode == "async_partial")


@dataclasses.dataclass
class LockstepSource:
    """mode=lockstep: the step's batch is generated when it is asked for; nothing runs beside the trainer."""

    maker: BatchMaker
    ready: dict[int, RolloutBatch] = dataclasses.field(default_factory=dict)  # a checkpoint's

    def next_batch(self, step: int) -> RolloutBatch:
        return self.ready.pop(step) if step in self.ready else self.maker.generate(step)

    def start(self, step: int) -> None:
        pass

    def verified(self, version: int) -> None:
        pass

    def refresh_access(self) -> ContextManager[None]:
        return contextlib.nullcontext()  # nothing generates between the loop's calls

    def exclusive(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def resume_state(self) -> RolloutState:
        return RolloutState(self.maker.stream.state_dict(), dict(self.ready))

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        self.ready = dict(ready)

    def stop(self) -> None:
        pass

    def join(self, deadline: float) -> None:
        pass


@dataclasses.dataclass
class PrefetchSource:
    """mode=overlap: the next step's batch generates in a thread (``offgrpo-rollout``) while the trainer learns from
    this one. The refresh comes after this step's batch is collected and before the next starts, so nothing
    generates while weights are installed (no gate: a refresh, evaluation or checkpoint waits on nothing)."""

    maker: BatchMaker
    last: int  # train.steps: nothing is prefetched past the last step
    ready: dict[int, RolloutBatch] = dataclasses.field(default_factory=dict)  # a checkpoint's
    _pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="offgrpo-rollout"))
    # (step, its generation, the stream's position before it drew): a failed prefetch's prompts are drawn again
    _pending: tuple[int, concurrent.futures.Future, dict[str, int]] | None = None

    def next_batch(self, step: int) -> RolloutBatch:
        """A checkpoint's ready batch, the batch ``start`` began during the previous step, else generated now."""
        if step in self.ready:
            return self.ready.pop(step)
        if self._pending is None:
            return self.maker.generate(step)
        (due, future, _), self._pending = self._pending, None
        if due != step:
            raise RuntimeError(f"the prefetched batch is step {due}'s, asked for step {step}'s")
        return future.result()

    def start(self, step: int) -> None:
        if step < self.last:
            before = self.maker.stream.state_dict()
            self._pending = (step, self._pool.submit(self.maker.generate, step), before)

    def verified(self, version: int) -> None:
        pass

    def refresh_access(self) -> ContextManager[None]:
        return contextlib.nullcontext()  # the loop refreshes between collecting a prefetch and starting the next

    def exclusive(self) -> ContextManager[None]:
        return contextlib.nullcontext()  # evaluation may run beside a prefetch: the engine serves both

    def resume_state(self) -> RolloutState:
        """A finished prefetch is kept (and still handed to ``next_batch``); a failed one is dropped and the stream
        rewound to before it, so that a resume draws its prompts again (its error is raised by ``next_batch``)."""
        ready, rewind = dict(self.ready), None
        if self._pending is not None:
            due, future, before = self._pending
            concurrent.futures.wait([future])
            if future.exception() is None:
                ready[due] = future.result()
            else:
                rewind = before
        return RolloutState(rewind or self.maker.stream.state_dict(), ready)

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        self.ready = dict(ready)

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self, deadline: float) -> None:
        pending = None if self._pending is None else self._pending[1]
        if pending is not None and not concurrent.futures.wait([pending], max(0.0, deadline - time.monotonic())).done:
            logger.warning("closing the rollout side: the prefetch of step %d still running when its wait ran out "
                           "(JOIN_TIMEOUT_S): left behind", self._pending[0])
        else:
            self._pool.shutdown(wait=True)  # nothing runs in it now: its idle thread ends at once


class AsyncSource:
    """mode=async and async_partial: ``sampler._async.AsyncGenerator`` generates ahead, up to the staleness bound
    past the verified version. Refreshes (unless ``partial``), evaluation and checkpoints take the engine alone
    (``EngineGate``): after the steps in flight end, before any new one starts."""

    def __init__(self, maker: BatchMaker, bound: int, last: int, concurrent: bool, partial: bool) -> None:
        """Args: maker: makes the batches. bound: the staleness bound. last: the run's step count. concurrent:
        several steps may generate at once. partial: a refresh comes between two decode steps of the steps in
        flight (the engine keeps each token's version) instead of waiting for them."""
        self.gate = EngineGate()
        self._maker, self._partial = maker, partial
        self._generator = AsyncGenerator(maker.generate, self.gate, bound, last, concurrent)

    def next_batch(self, step: int) -> RolloutBatch:
        return self._generator.take(step)

    def start(self, step: int) -> None:
        pass  # the generator starts steps on its own, as the bound allows

    def verified(self, version: int) -> None:
        self._generator.set_version(version)  # generation may now run up to version + the bound

    def refresh_access(self) -> ContextManager[None]:
        return contextlib.nullcontext() if self._partial else self.gate.exclusive()

    def exclusive(self) -> ContextManager[None]:
        return self.gate.exclusive()

    def resume_state(self) -> RolloutState:
        with self.gate.exclusive():  # no step in flight: the stream stands right after the ready batches
            return RolloutState(self._maker.stream.state_dict(), self._generator.ready_batches())

    def restore(self, ready: dict[int, RolloutBatch]) -> None:
        self._generator.restore(ready)

    def stop(self) -> None:
        self._generator.stop()

    def join(self, deadline: float) -> None:
        self._generator.close(max(0.0, deadline - time.monotonic()))
