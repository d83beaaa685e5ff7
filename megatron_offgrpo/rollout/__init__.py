"""Rollout: the engines that generate samples with versioned weights, and the weight refresh that feeds them.

``RolloutEngine`` is what the trainer calls; ``make_engine`` builds one: the vLLM fleet (``FleetEngine``, with a
``DiskTransport``, ``CollectiveTransport`` or ``SharedMemoryTransport`` refresh), an in-process ``VLLMEngine``, or
a ``TransformersEngine`` for machines without vLLM. ``verify_refresh`` checks a refresh against the trainer's probe
log-probs. Nothing here imports megatron: the rollout side runs where megatron is not installed.
"""

from megatron_offgrpo.rollout._collective import CollectiveTransport
from megatron_offgrpo.rollout._disk import DiskTransport
from megatron_offgrpo.rollout._dispatch import RetryPolicy
from megatron_offgrpo.rollout._errors import FleetError, RefreshError, RefreshVerificationError
from megatron_offgrpo.rollout._factory import have_vllm, make_engine
from megatron_offgrpo.rollout._fleet import FleetEngine
from megatron_offgrpo.rollout._hf_engine import TransformersEngine
from megatron_offgrpo.rollout._kv_cache import kv_cache_bytes
from megatron_offgrpo.rollout._launcher import (
    FleetSpec,
    fleet_status,
    is_loopback,
    is_this_machine,
    load_state,
    servers_of,
    start_fleet,
    stop_fleet,
)
from megatron_offgrpo.rollout._merge import merge_states
from megatron_offgrpo.rollout._protocol import Buckets, ProbeEngine, RolloutEngine, WeightTransport, WorkerTarget
from megatron_offgrpo.rollout._server import ServerClient
from megatron_offgrpo.rollout._server_size import ServerSize, size_server
from megatron_offgrpo.rollout._shm import SharedMemoryTransport
from megatron_offgrpo.rollout._tensors import DEFAULT_BUCKET_BYTES
from megatron_offgrpo.rollout._types import PROBE_ATOL, ProbeResult, RefreshReport, probe_atol
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh
from megatron_offgrpo.rollout._weights_dir import read_version_dir, version_dir, write_version_dir
from megatron_offgrpo.rollout._worker_ext import OffgrpoWorkerExtension

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "PROBE_ATOL",
    "Buckets",
    "CollectiveTransport",
    "DiskTransport",
    "FleetEngine",
    "FleetError",
    "FleetSpec",
    "OffgrpoWorkerExtension",
    "ProbeEngine",
    "ProbeResult",
    "RefreshError",
    "RefreshReport",
    "RefreshVerificationError",
    "RetryPolicy",
    "RolloutEngine",
    "ServerClient",
    "ServerSize",
    "SharedMemoryTransport",
    "TransformersEngine",
    "WeightTransport",
    "WorkerTarget",
    "fleet_status",
    "have_vllm",
    "is_loopback",
    "is_this_machine",
    "kv_cache_bytes",
    "load_state",
    "make_engine",
    "make_probe_ids",
    "merge_states",
    "probe_atol",
    "read_version_dir",
    "servers_of",
    "size_server",
    "start_fleet",
    "stop_fleet",
    "verify_refresh",
    "version_dir",
    "write_version_dir",
]


def __getattr__(name: str):
    # The in-process vLLM engine imports vllm (seconds, and absent on some machines): load it only when used.
    if name == "VLLMEngine":
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
