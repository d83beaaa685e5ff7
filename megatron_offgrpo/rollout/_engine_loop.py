"""One thread drives the in-process vLLM engine, so that generations asked for by several threads at once share its
continuous batch.

vLLM's ``LLM.generate`` runs the engine until its own requests are done: two calls from two threads would either
interleave unsafely or, serialised, leave every slot of the first call's batch idle while its longest response
finishes. Here the loop's thread alone touches the engine: callers hand it requests (``generate``) or calls
(``run``: weight installs, RPCs), which it takes between two decode steps, so a request that finishes frees its slot
for whichever waiting request comes first: the engine runs vLLM's priority scheduling, lowest ``priority`` first,
equal ones first come, first served. This is what lets ``rollout.mode=async`` generate the groups of several steps
at once without a batch waiting for its longest answer, the oldest step's requests admitted first.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 60.0
"""How long ``close`` waits for the loop's thread: it ends after the decode step it is in (seconds)."""


@dataclasses.dataclass
class _Generation:
    """One caller's requests: their outputs fill in as they finish, in the order of the prompts."""

    prompts: list[Any]
    params: list[Any]
    priority: int
    future: Future
    outputs: list[Any] = dataclasses.field(default_factory=list)
    pending: int = 0


@dataclasses.dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future


class EngineLoop:
    """The thread that owns a ``VllmCore``: every use of the engine goes through ``generate`` or ``run``."""

    def __init__(self, llm: Any, guard: Callable[[Callable[[], T]], T]) -> None:
        """Args: llm: the engine (``VllmCore``). guard: ``guard(fn)`` runs one engine call, ending it if the engine's
        process dies (``call_while_alive``)."""
        self._llm, self._guard = llm, guard
        self._jobs: queue.Queue[_Generation | _Call | None] = queue.Queue()
        self._waiting: dict[str, tuple[_Generation, int]] = {}  # request id -> its caller and its index there
        self._broken: BaseException | None = None  # the engine failed: every later job fails with this at once
        self._closed = False  # under _put_lock: no job is queued after close's None, where no thread would take it
        self._put_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="offgrpo-vllm-loop", daemon=True)
        self._thread.start()

    def generate(self, prompts: list[list[int]], params: list[Any], priority: int = 0) -> list[Any]:
        """vLLM's ``RequestOutput`` of each prompt (token ids), in order, generated beside every other caller's
        requests, admitted before those of a higher ``priority`` when the batch is full.

        Raises:
            what the engine raised (``EngineDiedError`` for a dead engine process).
        """
        job = _Generation(list(prompts), list(params), priority, Future())
        self._put(job)
        return job.future.result()

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop's thread, between two decode steps of the requests in flight."""
        job = _Call(fn, Future())
        self._put(job)
        return job.future.result()

    def close(self) -> None:
        """Fail the requests still in flight (and any asked for later) and stop the thread, waiting at most
        ``CLOSE_TIMEOUT_S`` for it, naming it if it is still running then. Idempotent."""
        with self._put_lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("closing the vLLM engine: its loop thread %s is still in a decode step after %.0f s: "
                           "left behind", self._thread.name, CLOSE_TIMEOUT_S)

    def _put(self, job: _Generation | _Call) -> None:
        with self._put_lock:
            if self._closed:  # the thread is gone or going: the job would wait for ever
                raise RuntimeError("the vLLM engine is closed")
            self._jobs.put(job)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a defect here must fail the callers, never leave them waiting
            self._broken = exc
            self._fail_waiting(exc)
            while True:  # answer every later job with the failure until close()
                job = self._jobs.get()
                if job is None:
                    return
                job.future.set_exception(exc)

    def _serve(self) -> None:
        while True:
            jobs = []
            try:  # nothing decoding: sleep until a job comes; else take what is queued and decode on
                jobs.append(self._jobs.get(block=not self._waiting))
                while True:
                    jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                pass
            for job in jobs:
                if job is None:
                    self._fail_waiting(RuntimeError("the vLLM engine was closed with requests in flight"))
                    return
                if self._broken is not None:
                    job.future.set_exception(self._broken)
                elif isinstance(job, _Call):
                    self._settle(job.future, job.fn)
                else:
                    self._start(job)
            if self._waiting:
                self._step()

    def _settle(self, future: Future, fn: Callable[[], Any]) -> None:
        try:
            future.set_result(self._guard(fn))
        except BaseException as exc:  # raised in the caller's thread
            future.set_exception(exc)

    def _start(self, job: _Generation) -> None:
        try:
            ids = self._guard(lambda: self._llm.add(job.prompts, job.params, job.priority))
        except BaseException as exc:
            job.future.set_exception(exc)
            return
        job.outputs, job.pending = [None] * len(ids), len(ids)
        if not ids:
            job.future.set_result([])
        for index, request_id in enumerate(ids):
            self._waiting[request_id] = (job, index)

    def _step(self) -> None:
        try:
            outputs = self._guard(self._llm.llm_engine.step)
        except BaseException as exc:  # a failed step leaves the engine's state unknown: nothing runs on it again
            self._broken = exc
            self._fail_waiting(exc)
            return
        for output in outputs:
            if not output.finished:
                continue
            job, index = self._waiting.pop(str(output.request_id))
            job.outputs[index] = output
            job.pending -= 1
            if job.pending == 0:
                job.future.set_result(job.outputs)

    def _fail_waiting(self, exc: BaseException) -> None:
        for job in {id(job): job for job, _ in self._waiting.values()}.values():
            if not job.future.done():
                job.future.set_exception(exc)
        self._waiting.clear()
