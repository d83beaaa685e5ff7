"""Checkpoints written in the background: megatron-core's asynchronous save (``dist_checkpointing.save(...,
async_sharded_save=True)``) run by its fork-based caller, one save at a time, every wait bounded.

megatron-core 0.16's ``AsyncCallsQueue(persistent=False)`` schedules the save's ``AsyncRequest`` on a
``TemporalAsyncCaller``: the tensors are staged to the host first (``preload_fn``: a device-to-host copy on GPU; on
CPU a copy too, ``runtime._fork_snapshot``), then one process is forked to write them (it forks a writer per file in
turn), and the trainer goes on. The staged copies are the snapshot: the trainer's next optimizer step, which changes
the parameters and optimizer state in place, changes pages the writer does not map. The spawned persistent worker is
not used: it imports torch in a new process and would move CPU tensors into shared memory.

What megatron leaves to the caller, done here:
- finalization on every rank, when every rank's writer has exited (one all-reduce of two flags): megatron's
  metadata, then ``commit`` (the caller's: the checkpoint made visible). ``poll`` finalizes a finished save without
  waiting; ``finish`` waits, at most ``timeout_s``, logging every 30 s what it waits for; a new save finishes the
  one in flight first.
- a failed or stuck writer is a ``SaveFailed`` on every rank (the same cause, with the free space of the rank's
  disk: torch's writer says only "unexpected pos" when the disk is full), never a checkpoint missing or
  repeated: a writer that exited with an error or died before handing its results back fails megatron's
  finalization (``CheckpointException``), one still running past ``timeout_s`` is killed with its own writers.
- the writer dies with the trainer (``PR_SET_PDEATHSIG``): a ``kill -9`` of the trainer leaves no process writing
  into the directory a resume sweeps. It ignores SIGINT and SIGTERM (a terminal's or a scheduler's signal to the
  whole process group is the trainer's to handle: it finalizes, then stops) and leads a process group of its own,
  so that ``abandon`` (a run ending on an error) and the timeout kill its writers with it.

``OFFGRPO_TEST_SAVE_DELAY_S`` (tests only): the forked writer sleeps that many seconds before writing, so that a
test can act while a background write is in flight.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_offgrpo.runtime._fork_snapshot import ForkSnapshot, step_tensors
from megatron_offgrpo.runtime._save_queue import results_through_file

logger = logging.getLogger(__name__)

DELAY_ENV = "OFFGRPO_TEST_SAVE_DELAY_S"
WAIT_S = 1800.0  # the longest a save waits for a writer (a 70B model's shard per rank is written in minutes)
PROGRESS_S = 30.0


class SaveFailed(RuntimeError):
    """A checkpoint written in the background was not written (raised on every rank, the same cause)."""


def _write_in_background(write: Callable, parent: int, *args, **kwargs) -> None:
    """The forked writer: dies with ``parent``, ignores the trainer's stop signals, then runs megatron's write."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except (AttributeError, OSError):
        pass  # no prctl: the writer may outlive a killed trainer (the resume sweeps what it wrote)
    if os.getppid() != parent:
        os._exit(1)  # the trainer died before the line above: write nothing
    os.setpgrp()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    time.sleep(float(os.environ.get(DELAY_ENV, "0")))
    write(*args, **kwargs)


class BackgroundSave:
    """This rank's checkpoint writes in the background (collective methods: every rank calls them in the same order).

    Args:
        device: where this job's collectives run (NCCL: the CUDA device; gloo: cpu).
        timeout_s: the longest ``finish`` waits for this rank's writer.
    """

    def __init__(self, device: torch.device | str, timeout_s: float = WAIT_S) -> None:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._new_queue = functools.partial(AsyncCallsQueue, persistent=False)
        self._calls = self._new_queue()
        self.device, self.timeout_s = device, timeout_s
        self.what: str | None = None  # the save in flight (its name in every line), None when none is
        self._snapshot = ForkSnapshot()  # a CPU job's host copies, reused by every save
        self._directory: Path | None = None  # the last save's
        self._started = 0.0

    def prepare(self, sharded_state_dict: dict, directory: Path):
        """megatron's save of ``sharded_state_dict`` into ``directory`` up to the writing (collective): the plan,
        rank 0's common state; returns the ``AsyncRequest`` that ``start`` writes. Its results come back through a
        file of ``directory`` (``runtime._save_queue``)."""
        from megatron.core import dist_checkpointing

        self._directory = Path(directory)
        with results_through_file(directory):
            return dist_checkpointing.save(sharded_state_dict, str(directory), async_sharded_save=True)

    def start(self, request, what: str, commit: Callable[[], None], model=None, optimizer=None) -> None:
        """Finish the save in flight, then fork the writer of ``request`` (megatron's ``AsyncRequest``) and return;
        ``commit`` runs on every rank after megatron's finalization, once every rank's writer is done. On CPU the
        saved tensors are copied, and they and every tensor a step of ``model`` and ``optimizer`` (megatron's) writes
        are kept out of the fork (``runtime._fork_snapshot``)."""
        self.finish("before the next save")
        request.add_finalize_fn(commit)
        if request.async_fn is not None:  # None: nothing of this checkpoint is written by this rank
            request = request._replace(async_fn=functools.partial(_write_in_background, request.async_fn, os.getpid()))
            if torch.device(self.device).type == "cpu" and request.preload_fn is not None:
                private = step_tensors(model, optimizer) if model is not None else []
                request = request._replace(preload_fn=self._snapshot.staging(request.preload_fn, private))
        try:
            self._calls.schedule_async_request(request)
        finally:
            self._snapshot.release()
        self.what, self._started = what, time.monotonic()
        logger.info("%s: writing in the background", what)

    def poll(self) -> None:
        """Finalize the save in flight if every rank's writer is done (else return at once)."""
        if self.what is not None:
            self._settle(timed_out=False)

    def finish(self, reason: str) -> None:
        """Wait for the save in flight (at most ``timeout_s``) and finalize it; ``reason`` names the wait in the
        progress lines. Nothing in flight: returns at once."""
        if self.what is None:
            return
        writer = self._writer()
        deadline = self._started + self.timeout_s
        while writer is not None and writer.is_alive() and time.monotonic() < deadline:
            writer.join(min(PROGRESS_S, max(deadline - time.monotonic(), 0.0)))
            if writer.is_alive():
                logger.info("%s: waiting for its background write (%s): %.0f s since it started", self.what, reason,
                            time.monotonic() - self._started)
        self._settle(timed_out=writer is not None and writer.is_alive())

    def abandon(self) -> None:
        """Stop this rank's writer without finalizing (a run ending on an error: the other ranks may be gone); the
        checkpoint stays an unpublished temporary directory. Local; nothing in flight: nothing done."""
        if self.what is not None:
            logger.warning("%s: not written (the run ends on an error while it was written in the background)",
                           self.what)
            self._kill()

    def _writer(self):
        """This rank's writer process (megatron's ``TemporalAsyncCaller.process``; None: nothing to write here)."""
        calls = self._calls.async_calls
        return calls[0].async_caller.process if calls else None

    def _settle(self, timed_out: bool) -> None:
        """Agree over the ranks whether every writer is done and whether one failed; finalize or raise."""
        writer = self._writer()
        alive = writer is not None and writer.is_alive()
        failed = timed_out or (writer is not None and not alive and writer.exitcode != 0)
        if failed:
            logger.error("%s: the background writer on this rank %s", self.what,
                         f"was still writing after {self.timeout_s:.0f} s" if timed_out
                         else f"exited with code {writer.exitcode}")
        rank = dist.get_rank() + 1  # 0: none
        flags = torch.tensor([int(alive and not timed_out), rank if failed and not timed_out else 0,
                              rank if timed_out else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[1] or flags[2]:
            what, (kind, rank) = self.what, (("timed out", flags[2]) if flags[2] else ("failed", flags[1]))
            self._kill()
            raise SaveFailed(f"{what}: not written: the background writer of rank {int(rank) - 1} {kind} (its log "
                             f"says how; {self._free_space()})")
        if flags[0]:
            return  # a writer is still at work somewhere
        self._finalize()

    def _finalize(self) -> None:
        from torch.distributed.checkpoint import CheckpointException

        what, self.what = self.what, None
        try:
            self._calls.maybe_finalize_async_calls(blocking=True)
        except CheckpointException as exc:  # a writer's error, raised on every rank (rank 0 has the details)
            self._calls = self._new_queue()
            causes = "; ".join(f"rank {rank}: {' '.join(str(failure[0]).split())}"
                               for rank, failure in sorted(exc.failures.items())) or "see rank 0's error"
            raise SaveFailed(f"{what}: not written: its background write failed ({causes}; {self._free_space()})"
                             ) from None
        logger.info("%s: background write done in %.1f s", what, time.monotonic() - self._started)

    def _free_space(self) -> str:
        """How much its disk has left: a full disk fails torch's writer with a bare "unexpected pos" error."""
        if self._directory is None:
            return "the disk's free space unknown"
        existing = next(path for path in (self._directory, *self._directory.parents) if path.exists())
        return f"{shutil.disk_usage(existing).free / 2**30:.1f} GiB free on the disk of {self._directory}"

    def _kill(self) -> None:
        """Kill this rank's writer and its own writers, forget the save."""
        writer = self._writer()
        if writer is not None and writer.is_alive():
            try:
                os.killpg(writer.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its group's leader
                writer.kill()
            writer.join(10)
        self._calls, self.what = self._new_queue(), None
