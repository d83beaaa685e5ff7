"""megatron-core's checkpoint write results, handed back without its spawned server: in process for a synchronous
save, through a file of the checkpoint's own directory for a save written by another process.

What it changes: ``megatron.core.dist_checkpointing.strategies.filesystem_async`` keeps one results queue per
process, made on the first save as ``multiprocessing.get_context("spawn").Manager().Queue()``: a server process
that unpickles what is put into it. The list of ``WriteResult`` it receives after each save makes that server import
torch.distributed.checkpoint, that is torch: 3.1 s of wall time and as much CPU on every process's first checkpoint
(a tiny CPU run's save took 4.4 s, 1.2 s of it the writing and fsync; measured 2026-11-26), plus 0.6 s to stop the
server at exit. Two replacements of that cached queue:

- ``use_in_process_save_queue()`` sets it to a ``queue.Queue`` before the first save. A synchronous save
  (``AsyncRequest.execute_sync``) runs the write function in the calling process: it forks one writer per file,
  collects their results through its own local queue, joins them, puts the results into the cached queue, and the
  same process takes them out right after (``retrieve_write_results``, ``get_nowait``).
- ``results_through_file(directory)``, around a save that returns an ``AsyncRequest`` (``train.async_save``): the
  writer made during that save keeps a ``FileResults`` queue whose one slot is a file of the checkpoint's directory,
  ``.write_results.<pid>.pkl``. The write function runs in a forked process (``runtime.BackgroundSave``), which
  puts its results there (pickled to a temporary name, then renamed); the finalization, in the trainer, reads and
  removes it. A pipe would not do: a forked process whose results outgrow the pipe's buffer never exits, and its
  exit is what megatron waits for before reading. The file belongs to that save alone, so a result can never be
  another save's, and a writer that died before putting one leaves the slot empty: megatron's "results_queue should
  not be empty", a failed save, never a checkpoint without its results. The cached queue is put back after the save.

The writers, their fsync and the files are unchanged; only the hand-over of the results list changes.

Versions: the module global ``_results_queue`` and ``_get_write_results_queue`` of megatron-core 0.16.x (our pin);
a megatron without them is left alone (nothing is set, the save works as before, only slower).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)


def _module():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_get_write_results_queue") or not hasattr(filesystem_async, "_results_queue"):
        return None
    return filesystem_async


def use_in_process_save_queue() -> bool:
    """Make megatron's checkpoint results queue an in-process ``queue.Queue`` (idempotent); whether it is one."""
    filesystem_async = _module()
    if filesystem_async is None:
        return False
    current = filesystem_async._results_queue
    if isinstance(current, queue.Queue):
        return True
    if current is not None:  # a save already made megatron's server queue: keep using it
        return False
    filesystem_async._results_queue = queue.Queue()
    logger.debug("megatron checkpoint write results: in-process queue (no spawned manager process)")
    return True


class FileResults:
    """A one-slot queue in a file: ``put`` in any process of this machine, ``get_nowait`` in the one that reads it
    (the two calls megatron makes of its results queue)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def put(self, item: Any) -> None:
        part = self.path.with_name(f"{self.path.name}.part")
        with open(part, "wb") as f:
            pickle.dump(item, f)
        os.replace(part, self.path)

    def get_nowait(self) -> Any:
        try:
            with open(self.path, "rb") as f:
                item = pickle.load(f)
        except FileNotFoundError:
            raise queue.Empty from None
        self.path.unlink()
        return item


@contextlib.contextmanager
def results_through_file(directory: str | Path) -> Iterator[FileResults | None]:
    """Within the block, megatron's writers made by a save into ``directory`` hand their results back through
    ``directory/.write_results.<pid>.pkl`` (``FileResults``, yielded; None on a megatron without the queue)."""
    filesystem_async = _module()
    if filesystem_async is None:
        yield None
        return
    results = FileResults(Path(directory) / f".write_results.{os.getpid()}.pkl")
    previous, filesystem_async._results_queue = filesystem_async._results_queue, results
    try:
        yield results
    finally:
        filesystem_async._results_queue = previous
