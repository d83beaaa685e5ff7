"""Fleet: what runs in or operates the vLLM servers the trainer generates with.

Inside each server: ``OffgrpoWorkerExtension`` (verified, versioned weight installs; vLLM loads it by the
dotted path ``transports.calls.WORKER_EXTENSION``; ``_moe_repack`` repairs vLLM CPU's MoE experts after a reload;
the routing it records for router replay comes back as a ``routing.RoutingAnswer``, claimed by
``routing.routing_key``) and ``ControlTokenMiddleware`` (the shared-token check), both loaded by vLLM from this door
by their dotted paths.
Around them: the launcher (``FleetSpec``, ``start_fleet`` / ``stop_fleet`` / ``fleet_status``, the recorded
``FleetState`` read by ``load_state``), and one name per set: ``launcher`` (the launcher's helpers:
``server_command``, ``server_url``, ``gpu_count``, ``is_loopback`` / ``is_this_machine``, ``write_token``),
``processes`` (the servers' processes and health: ``server_healthy``, ``check_server_health``, ``StopIncomplete``),
``records`` (the state directory: ``ServerRecord``, ``fleet_token``, ``TOKEN_ENV``, ``check_state_dir``, one fleet
per state directory, and ``merge_states`` for multi-node fleets), ``serving`` (``VllmSettings``, ``kv_cache_bytes``,
``size_server``, ``cpu_prefill_limits``), ``json_http`` (JSON over HTTP to a server: ``call_json``, ``ServerDown``,
``RequestRejected``) and ``cpu_sampler`` (vLLM CPU's inverse-CDF sampler: ``install``, ``sample_from_logprobs``).
``python -m megatron_offgrpo.cli.fleet`` is ``offgrpo fleet``. Nothing here imports megatron; the weight wire format
comes from ``transports``.
"""

from megatron_offgrpo.fleet import _cpu_sampler as cpu_sampler  # cpu_sampler.install(): vLLM CPU's sampler
from megatron_offgrpo.fleet import _http as json_http  # json_http.call_json(...): JSON over HTTP to a server
from megatron_offgrpo.fleet import _launcher as launcher  # launcher.server_url(...): the launcher's helpers
from megatron_offgrpo.fleet import _processes as processes  # processes.server_healthy(...): processes and health
from megatron_offgrpo.fleet import _records as records  # records.fleet_token(...): the state directory
from megatron_offgrpo.fleet import _routing_capture as routing  # routing.RoutingAnswer: router replay's answers
from megatron_offgrpo.fleet import _serving as serving  # serving.VllmSettings: what one engine serves with
from megatron_offgrpo.fleet._auth import ControlTokenMiddleware
from megatron_offgrpo.fleet._launcher import FleetSpec, start_fleet
from megatron_offgrpo.fleet._processes import fleet_status, stop_fleet
from megatron_offgrpo.fleet._state import FleetState, load_state
from megatron_offgrpo.fleet._worker_ext import OffgrpoWorkerExtension

__all__ = [
    "ControlTokenMiddleware",
    "FleetSpec",
    "FleetState",
    "OffgrpoWorkerExtension",
    "cpu_sampler",
    "fleet_status",
    "json_http",
    "launcher",
    "load_state",
    "processes",
    "records",
    "routing",
    "serving",
    "start_fleet",
    "stop_fleet",
]
