"""megatron-core's checkpoint write results, handed back in this process instead of through a spawned server.

What it changes: ``megatron.core.dist_checkpointing.strategies.filesystem_async`` keeps one results queue per
process, made on the first save as ``multiprocessing.get_context("spawn").Manager().Queue()``: a server process
that unpickles what is put into it. The list of ``WriteResult`` it receives after each save makes that server import
torch.distributed.checkpoint, that is torch: 3.1 s of wall time and as much CPU on every process's first checkpoint
(a tiny CPU run's save took 4.4 s, 1.2 s of it the writing and fsync; measured 2026-11-26), plus 0.6 s to stop the
server at exit. ``use_in_process_save_queue()`` sets that cached queue to a ``queue.Queue`` before the first save.

Why it is equivalent: ``dist_checkpointing.save`` without ``async_sharded_save`` (the only way this project saves,
``train._checkpoint``) runs the write function in the calling process (``AsyncRequest.execute_sync``): it forks
one writer per file, collects their results through its own local queue, joins them, then puts the results into the
cached queue, and the same process takes them out right after (``retrieve_write_results``, ``get_nowait``). The
writers, their fsync and the files are unchanged; only the hand-over within one process no longer crosses a
process. An asynchronous save (the write function in another process) would find the queue empty and raise
megatron's "results_queue should not be empty": loudly, never a checkpoint missing its results.

Versions: the module global ``_results_queue`` and ``_get_write_results_queue`` of megatron-core 0.16.x (our pin);
a megatron without them is left alone (nothing is set, the save works as before, only slower).
"""

from __future__ import annotations

import logging
import queue

logger = logging.getLogger(__name__)


def use_in_process_save_queue() -> bool:
    """Make megatron's checkpoint results queue an in-process ``queue.Queue`` (idempotent); whether it is one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_get_write_results_queue") or not hasattr(filesystem_async, "_results_queue"):
        return False
    current = filesystem_async._results_queue
    if isinstance(current, queue.Queue):
        return True
    if current is not None:  # a save already made megatron's server queue: keep using it
        return False
    filesystem_async._results_queue = queue.Queue()
    logger.debug("megatron checkpoint write results: in-process queue (no spawned manager process)")
    return True
