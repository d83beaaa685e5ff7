"""Transports: how one weight version travels from the trainer into the fleet's workers, and its wire format.

Every transport is a ``WeightTransport`` (``prepare`` / ``install`` / ``metrics`` -> ``TransferMetrics`` /
``close``): ``DiskTransport`` writes a version directory each server reloads from, ``CollectiveTransport``
broadcasts buckets over a private gloo/NCCL group, ``SharedMemoryTransport`` packs buckets into RAM-backed files the
servers map. The wire format they share with the fleet's worker extension lives here too, one name per part:
``weights_dir`` (version directories: ``write_version_dir`` / ``read_version_dir``, ``version_dir``,
``manifest_version``, ``prune_versions``), ``packing`` (buckets packed into one buffer: ``pack_bucket``,
``bucket_layout``, ``unpack_entries``, the completeness check ``check_complete``, ``DEFAULT_BUCKET_BYTES``),
``gloo`` (the gloo stream: ``make_store`` / ``make_group``, ``send_stream`` / ``recv_stream`` and its message
kinds), ``calls`` (the worker-extension calls: ``calls.WorkerRequest`` and one class per method, the only place a
method's name is written, and ``calls.WORKER_EXTENSION``, the dotted path vLLM loads them from) and the worker
answers (``WorkerAnswer``, ``summarize``, ``DIRTY``), ``adapters`` (the LoRA adapter payload every transport carries
too: ``AdapterSpec``, ``AdapterPayload``, its PEFT tensor names, the engine's one LoRA slot), and ``deltas`` (the
delta payload: per tensor the changed elements of the engine-dtype image, checksummed, applied only onto its base
version: ``encode`` / ``apply``, ``DeltaSpec``, ``DeltaPayload``). Nothing here imports megatron.
"""

from megatron_offgrpo.transports import _adapter as adapters  # adapters.AdapterPayload(spec, buckets): LoRA refreshes
from megatron_offgrpo.transports import _delta as deltas  # deltas.DeltaPayload(spec, buckets, full): delta refreshes
from megatron_offgrpo.transports import _gloo as gloo  # gloo.send_stream(...): the gloo stream and its kinds
from megatron_offgrpo.transports import _tensors as packing  # packing.pack_bucket(...): buckets in one buffer
from megatron_offgrpo.transports import _weights_dir as weights_dir  # weights_dir.write_version_dir(...)
from megatron_offgrpo.transports import _worker_calls as calls  # calls.LoadDir(...): one name for the method set
from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._collective import CollectiveTransport
from megatron_offgrpo.transports._disk import DiskTransport
from megatron_offgrpo.transports._protocol import DIRTY, Buckets, TransferMetrics, WeightTransport
from megatron_offgrpo.transports._rpc import summarize
from megatron_offgrpo.transports._shm import SharedMemoryTransport

__all__ = [
    "DIRTY",
    "Buckets",
    "CollectiveTransport",
    "DiskTransport",
    "SharedMemoryTransport",
    "TransferMetrics",
    "WeightTransport",
    "WorkerAnswer",
    "adapters",
    "calls",
    "deltas",
    "gloo",
    "packing",
    "summarize",
    "weights_dir",
]
