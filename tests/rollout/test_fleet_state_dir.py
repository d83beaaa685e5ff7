"""One fleet per state directory, and a stop that says "stopped" only for processes verified gone.

No vLLM: each "server" is a real sleeping Python process whose command line is a fleet server's (the module name and
its port, what ``pid_runs_server`` checks), recorded by the real ``FleetState.write``; the real CLI runs against it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from megatron_offgrpo.cli.fleet import main as fleet_main
from megatron_offgrpo.fleet import FleetState, launcher, load_state, records, stop_fleet
from megatron_offgrpo.fleet._claim import claim_state_dir
from megatron_offgrpo.fleet._processes import _wait_gone, group_members

# the leader optionally ignores SIGTERM and starts a child in its process group (as a tp > 1 server's workers),
# then sleeps; with "orphan" the leader exits at once and leaves the child behind
SERVER = """
import signal, subprocess, sys, time
mode = sys.argv[1]
if "stubborn" in mode:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "child" in mode or "orphan" in mode:
    subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(120)"])
print("ready", flush=True)
if "orphan" not in mode:
    time.sleep(120)
"""


def _server(port: int, mode: str = "plain") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, mode, "vllm.entrypoints.openai.api_server", "--port",
                             str(port)], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # handlers set, child started
    return proc


def _record(state_dir, procs: list[tuple[int, subprocess.Popen]]) -> FleetState:
    """The fleet.json `offgrpo fleet start` writes for these processes, and its token file."""
    state_dir.mkdir(parents=True, exist_ok=True)
    servers = [records.ServerRecord(name=f"s{i}@127.0.0.1:{port}", url=f"http://127.0.0.1:{port}", port=port,
                            log=str(state_dir / f"server{i}.log"), pid=proc.pid)
               for i, (port, proc) in enumerate(procs)]
    state = FleetState("m", "policy", str(launcher.write_token(state_dir / "token", "first-token")), servers)
    state.write(state_dir)
    return state


@pytest.fixture
def processes():
    """Every process a test starts, killed with its group at the end whatever happened."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        for pid in group_members(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def _files(state_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(state_dir.iterdir()) if p.name != "fleet.lock"}


@pytest.mark.parametrize("mode", ["plain", "orphan"])
def test_a_second_start_on_a_running_fleet_is_refused_and_overwrites_nothing(mode, processes, tiny_dir, tmp_path,
                                                                              capsys):
    """Was: accepted (exit 0), fleet.json and the token overwritten, the first fleet orphaned and running on.
    "orphan": the leader has exited and a worker of its group runs on (still the fleet's processes)."""
    state_dir = tmp_path / "fleet"
    processes.append(_server(8123, mode))
    _record(state_dir, [(8123, processes[0])])
    before = _files(state_dir)
    # /bin/false as the servers' interpreter: were the check to let the start through, no vLLM would be left running
    argv = ["start", "--model", str(tiny_dir), "--num-servers", "1", "--python", "/bin/false", "--timeout", "30"]
    assert fleet_main([*argv, "--state-dir", str(state_dir)]) == 2
    out, err = capsys.readouterr()
    assert err == (f"error: {state_dir}: a fleet runs there (s0@127.0.0.1:8123 (pid {processes[0].pid})): stop it "
                   f"first (offgrpo fleet stop --state-dir {state_dir}) or choose another --state-dir\n")
    assert out == "" and _files(state_dir) == before  # nothing printed, nothing overwritten

    # the fleet stops, verified: every process of its group is gone when `stop` says so
    members = group_members(processes[0].pid)
    assert members
    assert fleet_main(["stop", "--state-dir", str(state_dir)]) == 0
    assert capsys.readouterr().out == "stopped 1 server(s): s0@127.0.0.1:8123\n"
    assert group_members(processes[0].pid) == [] and not any(psutil.pid_exists(p) and
                                                             psutil.Process(p).status() != "zombie" for p in members)


def test_a_stale_state_dir_is_reused_with_a_note(processes, tiny_dir, tmp_path, capsys):
    state_dir = tmp_path / "fleet"
    dead = _server(8124)
    dead.kill()
    dead.wait()
    _record(state_dir, [(8124, dead)])
    # a real start through every step after the check: its "server" (/bin/false) exits at once, so it fails there
    argv = ["start", "--model", str(tiny_dir), "--num-servers", "1", "--python", "/bin/false", "--timeout", "30"]
    assert fleet_main([*argv, "--state-dir", str(state_dir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"offgrpo fleet: {state_dir / 'fleet.json'}: its fleet (s0@127.0.0.1:8124 (pid {dead.pid})) "
                      "no longer runs: replacing it")
    assert err[1].startswith("error: server s0@127.0.0.1:") and "exited during start" in err[1], err
    assert load_state(state_dir).servers[0].pid != dead.pid  # the new start's record
    assert (state_dir / "token").read_text() != "first-token"


def test_a_start_in_progress_holds_the_state_dir(processes, tiny_dir, tmp_path, capsys):
    """Two starts at once: the second is refused while the first holds the directory, and writes nothing."""
    state_dir = tmp_path / "fleet"
    with claim_state_dir(state_dir) as note:  # the first start, between its check and its record
        assert note is None
        argv = ["start", "--model", str(tiny_dir), "--python", "/bin/false", "--timeout", "30"]  # never a vLLM
        assert fleet_main([*argv, "--state-dir", str(state_dir)]) == 2
        out, err = capsys.readouterr()
        assert err == (f"error: {state_dir}: another `offgrpo fleet start` (pid {os.getpid()}) is starting a fleet "
                       f"there: wait for it, then see `offgrpo fleet status --state-dir {state_dir}`\n")
        assert out == "" and [p.name for p in state_dir.iterdir()] == ["fleet.lock"]
    with claim_state_dir(state_dir) as note:  # released by the first: free again
        assert note is None


def test_stop_waits_for_processes_that_ignore_sigterm(processes, tmp_path):
    """SIGTERM ignored by the leader and by a worker of its group: SIGKILL after the grace, and the names come
    back only once the whole group is gone."""
    processes.append(_server(8125, "stubborn child"))
    processes.append(_server(8126))
    _record(tmp_path, [(8125, processes[0]), (8126, processes[1])])
    stubborn = group_members(processes[0].pid)
    assert len(stubborn) == 2
    start = time.monotonic()
    assert stop_fleet(tmp_path, grace_s=0.5) == ["s0@127.0.0.1:8125", "s1@127.0.0.1:8126"]
    assert 0.5 <= time.monotonic() - start < 5  # waited out the grace, then killed
    assert group_members(processes[0].pid) == group_members(processes[1].pid) == []


def test_the_wait_for_a_group_to_go_is_bounded(processes, tmp_path):
    processes.append(_server(8127))
    (server,) = _record(tmp_path, [(8127, processes[0])]).servers
    start = time.monotonic()
    assert _wait_gone([server], 0.3) == [server]  # still running (never signalled): named, after the bound
    assert 0.3 <= time.monotonic() - start < 2
    processes[0].kill()
    processes[0].wait()
    assert _wait_gone([server], 5.0) == []


def test_stop_refuses_a_record_without_pids(tmp_path, capsys):
    """A hand-written started fleet's record without pids (was: a TypeError traceback from os.killpg(None))."""
    (tmp_path / "fleet.json").write_text('{"model_dir": "m", "served_model_name": "policy", "servers": '
                                         '[{"name": "s0", "url": "http://127.0.0.1:8000", "port": 8000}]}')
    assert fleet_main(["stop", "--state-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path}: servers ['s0'] have no pid recorded: stop them by hand "
                                       "on their node\n")


def test_merge_never_replaces_a_running_fleet(processes, tmp_path, capsys):
    """`fleet merge --state-dir DIR` over a fleet started in DIR would orphan it as a second start did."""
    processes.append(_server(8128))
    _record(tmp_path / "node0", [(8128, processes[0])])
    before = _files(tmp_path / "node0")
    assert fleet_main(["merge", "--state-dir", str(tmp_path / "node0"), str(tmp_path / "node0")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'node0'}: a fleet runs there (s0@127.0.0.1:8128")
    assert _files(tmp_path / "node0") == before
    assert fleet_main(["merge", "--state-dir", str(tmp_path / "all"), str(tmp_path / "node0")]) == 0  # elsewhere: fine


def test_a_state_dir_that_cannot_be_one_is_named(tiny_dir, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a directory")
    argv = ["start", "--model", str(tiny_dir), "--python", "/bin/false", "--state-dir", str(tmp_path / "taken" / "x")]
    assert fleet_main(argv) == 2  # was: a FileExistsError / NotADirectoryError traceback
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: --state-dir={tmp_path / 'taken' / 'x'}: cannot hold a fleet's "
                                        "state there (")
