"""Fleet: what runs in or operates the vLLM servers the trainer generates with.

Inside each server: ``OffgrpoWorkerExtension`` (verified, versioned weight installs; vLLM loads it by the dotted
path ``transports.WORKER_EXTENSION``; ``repack_after_reload`` repairs vLLM CPU's MoE experts after a reload; the
routing it records for router replay comes back as a ``RoutingAnswer``, claimed by ``routing_key``) and
``ControlTokenMiddleware`` (the shared-token check). Around them: the launcher (``FleetSpec``, ``start_fleet`` /
``stop_fleet`` / ``fleet_status``, the recorded ``FleetState`` read by ``load_state``, one fleet per state
directory held by ``claim_state_dir``), server sizing
(``size_server``, ``kv_cache_bytes``), ``merge_states`` for multi-node fleets, and JSON over HTTP to a server
(``call_json``). ``python -m megatron_offgrpo.cli.fleet`` is ``offgrpo fleet``. Nothing here imports megatron; the
weight wire format comes from ``transports``.
"""

from megatron_offgrpo.fleet._auth import TOKEN_ENV, ControlTokenMiddleware
from megatron_offgrpo.fleet._claim import check_state_dir
from megatron_offgrpo.fleet._cpu_sampler import install as install_cpu_sampler
from megatron_offgrpo.fleet._cpu_sampler import sample_from_logprobs
from megatron_offgrpo.fleet._http import RequestRejected, ServerDown, call_json
from megatron_offgrpo.fleet._kv_cache import kv_cache_bytes
from megatron_offgrpo.fleet._launcher import (
    EXTENSION,
    FleetSpec,
    gpu_count,
    is_loopback,
    is_this_machine,
    server_command,
    server_url,
    start_fleet,
    write_token,
)
from megatron_offgrpo.fleet._merge import merge_states
from megatron_offgrpo.fleet._moe_repack import MoeLayoutError, repack_after_reload
from megatron_offgrpo.fleet._routing_capture import RoutingAnswer, routing_key
from megatron_offgrpo.fleet._processes import (
    StopIncomplete,
    check_server_health,
    fleet_status,
    server_healthy,
    stop_fleet,
)
from megatron_offgrpo.fleet._server_size import cpu_prefill_limits, size_server
from megatron_offgrpo.fleet._vllm_settings import VllmSettings
from megatron_offgrpo.fleet._state import FleetState, ServerRecord, fleet_token, load_state
from megatron_offgrpo.fleet._worker_ext import OffgrpoWorkerExtension

__all__ = [
    "EXTENSION",
    "VllmSettings",
    "TOKEN_ENV",
    "ControlTokenMiddleware",
    "FleetSpec",
    "gpu_count",
    "install_cpu_sampler",
    "sample_from_logprobs",
    "FleetState",
    "MoeLayoutError",
    "OffgrpoWorkerExtension",
    "RequestRejected",
    "RoutingAnswer",
    "ServerDown",
    "ServerRecord",
    "StopIncomplete",
    "call_json",
    "check_server_health",
    "check_state_dir",
    "cpu_prefill_limits",
    "fleet_status",
    "fleet_token",
    "is_loopback",
    "is_this_machine",
    "kv_cache_bytes",
    "load_state",
    "merge_states",
    "repack_after_reload",
    "routing_key",
    "server_command",
    "server_healthy",
    "server_url",
    "size_server",
    "start_fleet",
    "stop_fleet",
    "write_token",
]
