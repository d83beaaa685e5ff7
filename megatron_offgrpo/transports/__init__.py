"""Transports: how one weight version travels from the trainer into the fleet's workers, and its wire format.

Every transport is a ``WeightTransport`` (``prepare`` / ``install`` / ``metrics`` / ``close``): ``DiskTransport``
writes a version directory each server reloads from, ``CollectiveTransport`` broadcasts buckets over a private
gloo/NCCL group, ``SharedMemoryTransport`` packs buckets into RAM-backed files the servers map. The wire format
they share with the fleet's worker extension lives here too: version directories (``write_version_dir`` /
``read_version_dir``), packed buckets (``pack_bucket``, ``bucket_layout``, ``unpack_entries``), the gloo stream
(``send_stream`` / ``recv_stream``), the worker-extension calls (``calls``: ``calls.WorkerRequest`` and one class per
method, the only place a method's name is written) and the worker answers (``WorkerAnswer``, ``summarize``,
``DIRTY``). Nothing here imports megatron.
"""

from megatron_offgrpo.transports import _worker_calls as calls  # calls.LoadDir(...): one name for the method set
from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._collective import CollectiveTransport
from megatron_offgrpo.transports._disk import DiskTransport
from megatron_offgrpo.transports._gloo import ABORT, BUCKET, END, make_group, make_store, recv_stream, send_stream
from megatron_offgrpo.transports._protocol import (
    DIRTY,
    WORKER_EXTENSION,
    Buckets,
    TransferMetrics,
    WeightTransport,
    WorkerTarget,
)
from megatron_offgrpo.transports._rpc import call_targets, summarize
from megatron_offgrpo.transports._shm import SharedMemoryTransport, sweep_dead_sessions
from megatron_offgrpo.transports._tensors import (
    DEFAULT_BUCKET_BYTES,
    Named,
    bucket_layout,
    bucket_stream,
    check_complete,
    pack_bucket,
    pack_into,
    unpack_bucket,
    unpack_entries,
)
from megatron_offgrpo.transports._weights_dir import (
    manifest_version,
    prune_versions,
    read_version_dir,
    version_dir,
    write_version_dir,
)

__all__ = [
    "ABORT",
    "BUCKET",
    "DEFAULT_BUCKET_BYTES",
    "DIRTY",
    "END",
    "WORKER_EXTENSION",
    "Buckets",
    "CollectiveTransport",
    "DiskTransport",
    "Named",
    "SharedMemoryTransport",
    "TransferMetrics",
    "WeightTransport",
    "WorkerAnswer",
    "WorkerTarget",
    "bucket_layout",
    "calls",
    "bucket_stream",
    "call_targets",
    "check_complete",
    "make_group",
    "make_store",
    "manifest_version",
    "pack_bucket",
    "pack_into",
    "prune_versions",
    "read_version_dir",
    "recv_stream",
    "send_stream",
    "summarize",
    "sweep_dead_sessions",
    "unpack_bucket",
    "unpack_entries",
    "version_dir",
    "write_version_dir",
]
