"""Operating a started fleet: is a server up (``/health``, its version label), stop it, and the fleet's status.

``stop_fleet`` signals the process groups the launcher recorded, only while they still run our command line
(a recycled pid is never signalled); a merged state (``merge_states``) records no pids and is refused.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil

from megatron_offgrpo.fleet._http import RequestRejected, ServerDown, call_json
from megatron_offgrpo.fleet._state import ServerRecord, fleet_token, load_state
from megatron_offgrpo.runtime import process_alive


def check_server_health(url: str, timeout: float = 5.0) -> None:
    """Raises ``ServerDown`` (or ``RequestRejected``) unless the server at ``url`` answers ``/health`` within
    ``timeout``."""
    call_json("GET", url + "/health", None, None, timeout)


def server_healthy(url: str, timeout: float = 5.0) -> bool:
    """True when the server at ``url`` answers ``/health``."""
    try:
        check_server_health(url, timeout)
        return True
    except (ServerDown, RequestRejected):
        return False


def server_version_label(url: str, token: str | None, timeout: float) -> str:
    """The engine's current weight-version label (vLLM's ``/weight_info``)."""
    return str(call_json("GET", url + "/weight_info", None, token, timeout)["weight_version"])


def pid_runs_server(server: ServerRecord) -> bool:
    """True when ``pid`` is alive and still runs the vLLM server on this port (not a recycled pid)."""
    if not process_alive(server.pid):
        return False
    try:
        cmdline = psutil.Process(server.pid).cmdline()
    except psutil.Error:  # gone since, or another user's: not our server
        return False
    return "vllm.entrypoints.openai.api_server" in cmdline and str(server.port) in cmdline


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_is_ours(server: ServerRecord) -> bool:
    """The process group (id = the server's pid) still belongs to the server we started.

    Either the leader still runs our command line (or is our unreaped zombie), or the leader is gone: then no
    process can have been given its id while members of its group remain, so the group is our orphans.
    """
    # no such process (only our orphans can hold the group id), or our server exited and not yet reaped
    return not process_alive(server.pid) or pid_runs_server(server)


def stop_fleet(state_file: str | Path, grace_s: float = 20.0) -> list[str]:
    """SIGTERM each server's process group (by recorded pid), SIGKILL after ``grace_s``; returns names stopped."""
    state = load_state(state_file)
    if state.merged_from:
        raise ValueError(
            f"{state_file} is a merged view of the fleets {state.merged_from}: their pids live on "
            "their own nodes; stop each there (offgrpo fleet stop --state-dir SOURCE)"
        )
    targets = [s for s in state.servers if _group_alive(s.pid) and _group_is_ours(s)]
    for server in targets:
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for server in targets:
        while _group_alive(server.pid) and time.monotonic() < deadline:
            _reap(server.pid)
            time.sleep(0.2)
        if _group_alive(server.pid):
            os.killpg(server.pid, signal.SIGKILL)
        _reap(server.pid)
    return [s.name for s in targets]


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def fleet_status(state_file: str | Path) -> list[dict[str, Any]]:
    """Per server: name, url, pid, whether the process runs, answers /health, and its version label.

    A merged state (``merge_states``) records no pids: ``running`` is None there and ``healthy`` is /health alone.
    """
    state = load_state(state_file)
    rows = []
    token = fleet_token(state)
    for server in state.servers:
        running = pid_runs_server(server) if server.pid is not None else None
        row = {"name": server.name, "url": server.url, "pid": server.pid, "running": running}
        row["healthy"] = running is not False and server_healthy(server.url, 2.0)
        try:
            row["version"] = server_version_label(server.url, token, 5.0) if row["healthy"] else None
        except Exception as exc:
            row["version"] = f"? ({exc})"
        rows.append(row)
    return rows
