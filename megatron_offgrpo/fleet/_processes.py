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
from megatron_offgrpo.fleet._state import FleetState, ServerRecord, fleet_token, load_state
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


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a zombie has exited: it holds no core and no memory)."""
    try:
        os.killpg(pgid, 0)  # the cheap answer for the common case: no such group
    except (ProcessLookupError, PermissionError):
        return []
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
        except (OSError, psutil.Error):  # gone since
            continue
    return members


def _group_is_ours(server: ServerRecord) -> bool:
    """The process group (id = the server's pid) still belongs to the server we started.

    Either the leader still runs our command line, or the leader is gone or going: then no process can have been
    given its id while members of its group remain, so the group is our orphans (a tp > 1 server's workers).
    """
    try:
        cmdline = psutil.Process(server.pid).cmdline()
    except psutil.NoSuchProcess:  # gone, or a zombie (ZombieProcess): exited, perhaps since process_alive said no
        return True
    except psutil.AccessDenied:  # another user's process: not one we started
        return False
    # empty: a leader between releasing its memory and becoming a zombie (kernel threads lead no group of their id)
    return not cmdline or ("vllm.entrypoints.openai.api_server" in cmdline and str(server.port) in cmdline)


def running_servers(state: FleetState) -> list[ServerRecord]:
    """The servers of ``state`` whose process group still runs here and is ours (a recycled pid is not)."""
    return [s for s in state.servers if s.pid is not None and group_members(s.pid) and _group_is_ours(s)]


def describe_servers(servers: list[ServerRecord]) -> str:
    """``s0@127.0.0.1:8100 (pid 123), ...``: which processes, for a message."""
    return ", ".join(f"{s.name} (pid {s.pid})" for s in servers)


class StopIncomplete(RuntimeError):
    """``stop_fleet`` signalled a server's processes and some still run after SIGKILL and the bounded wait."""


def stop_fleet(state_file: str | Path, grace_s: float = 20.0, kill_wait_s: float = 10.0) -> list[str]:
    """SIGTERM each server's process group (by recorded pid), SIGKILL what remains after ``grace_s``, then wait up to
    ``kill_wait_s`` until every process of the groups is gone. Returns the names stopped (all verified gone).

    Raises:
        ValueError: a merged view, or a server with no pid (nothing here can stop it).
        StopIncomplete: processes still run after the waits (named, with their pids).
    """
    state = load_state(state_file)
    if state.merged_from:
        raise ValueError(
            f"{state_file} is a merged view of the fleets {state.merged_from}: their pids live on "
            "their own nodes; stop each there (offgrpo fleet stop --state-dir SOURCE)"
        )
    unknown = [s.name for s in state.servers if s.pid is None]
    if unknown:
        raise ValueError(f"{state_file}: servers {unknown} have no pid recorded: stop them by hand on their node")
    targets = running_servers(state)
    _signal(targets, signal.SIGTERM)
    left = _wait_gone(targets, grace_s)
    _signal(left, signal.SIGKILL)
    left = _wait_gone(left, kill_wait_s)
    if left:
        alive = "; ".join(f"{s.name}: pids {group_members(s.pid)}" for s in left)
        stopped = [s.name for s in targets if s not in left]
        raise StopIncomplete(
            f"{state_file}: still running {kill_wait_s:g} s after SIGKILL ({alive}); stopped {stopped or 'none'}: "
            f"look at them (ps -o pid,stat,cmd -g PGID) and kill them by hand"
        )
    return [s.name for s in targets]


def _signal(servers: list[ServerRecord], sig: signal.Signals) -> None:
    for server in servers:
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:  # gone since
            pass


def _wait_gone(servers: list[ServerRecord], timeout_s: float) -> list[ServerRecord]:
    """Wait up to ``timeout_s`` until no process of each server's group runs; returns the servers with some left."""
    deadline = time.monotonic() + timeout_s
    while True:
        for server in servers:
            _reap(server.pid)  # our own child (a start that failed): its zombie would count until reaped
        left = [s for s in servers if group_members(s.pid)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


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
