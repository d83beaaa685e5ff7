"""End-to-end CPU runs of the trainer under torchrun (gloo): layouts, refresh cadence, staleness, resume. The
gradient checks of whole jobs (tests/workers/train_*_worker.py) are tests/train/test_e2e_gradients.py: a file is one
unit of the suite's two workers (tests/_budget.py), and together they took 19 min."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time

import pytest

from megatron_offgrpo.rollout import have_vllm
from tests.helpers import REPO
from tests.helpers import turn_ending_model
from tests.train.conftest import kill_tree, metrics, run_train, train_cmd, train_env, train_proc

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


MOE = "model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe"  # 8 experts, top-2


@pytest.fixture(scope="module")
def turn_ending_dir(tmp_path_factory):
    return turn_ending_model(tmp_path_factory.mktemp("episodes") / "model")


@pytest.mark.parametrize("tp,pp,ep,v,overlap,episodes", [(2, 1, 1, 1, False, True), (1, 2, 1, 4, False, False),
                                                         (1, 1, 1, 2, True, False), (1, 1, 2, 2, False, False)],
                         ids=["tp2-v1-episodes", "pp2-v4", "tp1-v2-overlap", "moe-ep2-v2"])
def test_training_runs_with_versions_and_bounded_staleness(tmp_path, turn_ending_dir, tp, pp, ep, v, overlap,
                                                           episodes):
    steps = 5
    # the MoE run replays the routing vLLM recorded (its engine core a process of its own under a job of 2 ranks) in
    # the trainer (the recipe's run, without it, is a docs test)
    engine = "rollout.engine=vllm" if have_vllm() else "rollout.engine=transformers"
    moe = [MOE, f"parallel.ep={ep}", "model.router_replay=true", engine] if ep > 1 else []
    # multi-turn feedback episodes, on the in-process vLLM engine, packed, from a model that ends its turns
    multi = [f"model.hf_path={turn_ending_dir}", "model.init=hf", "env.name=feedback", "env.max_turns=3",
             "env.max_tokens=64", engine, "optim.packing=true"] if episodes else []
    proc = train_proc(tp * pp * ep, tmp_path, f"parallel.tp={tp}", f"parallel.pp={pp}", f"rollout.refresh_every={v}",
                      f"train.steps={steps}", f"rollout.mode={'overlap' if overlap else 'lockstep'}", *moe, *multi)
    records = metrics(tmp_path)
    if episodes:  # several turns per episode, the trainer's token count the model's tokens only
        assert max(r["episode_turns_mean"] for r in records) > 1.2
        assert all(0 <= r["episode_truncated_fraction"] <= 1 and r["tool_error_rate"] == 0 for r in records)
    if moe:  # the router's load, every step: 8 experts, top-2 of every routed position, in each of the 2 layers
        for r in records:
            assert len(r["moe_tokens_per_expert"]) == 8 and r["moe_load_max"] >= 1.0 >= r["moe_load_min"] >= 0
            assert sum(r["moe_tokens_per_expert"]) % (2 * 2) == 0 and r["moe_aux_loss"] > 0
    # the end-of-run summary: printed once per job (global rank 0), not once per torchrun rank, and written
    assert proc.stdout.count("run summary:") == 1 and f"{steps} steps in" in proc.stdout, proc.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["refresh_every"] == v
    assert [r["step"] for r in records] == list(range(steps))
    for r in records:
        # the engine is refreshed at every multiple of v; samples carry the version that generated them, and
        # their staleness stays within v - 1 (v when the next batch is generated during this step's training)
        assert r["policy_version"] == v * (r["step"] // v)
        assert 0 <= r["staleness_max"] <= v - 1 + overlap
        assert math.isfinite(r["loss"]) and not r["skipped"]
    assert any(0 < r["reward_mean"] < 1 for r in records), "rewards did not flow"
    assert any(r["masked_group_fraction"] < 1 for r in records) and any(r["grad_norm"] > 0 for r in records)
    assert (tmp_path / "checkpoints" / f"step_{steps:08d}" / "trainer_state.json").exists()


STATE = "trainer_state.json"
COMMON = ["train.steps=6", "train.save_every=2", "rollout.refresh_every=2"]  # save_every a multiple of v


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    metrics = run_train(1, out, *COMMON)
    shutil.rmtree(out)  # only the metrics are compared: free the 1.2 GB of checkpoints and weights at once
    return metrics


def _steps_logged(out) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


KILL_POINTS = {  # when to SIGKILL the run: a state visible on disk, polled every 20 ms
    "before-any-checkpoint": lambda out: _steps_logged(out) >= 1,  # step 1's generation: resumes from step 0
    "during-the-first-checkpoint-write": lambda out: any((out / "checkpoints").glob("step_*.tmp")),
    # the step-4 checkpoint is complete: what follows is step 4's refresh (v=2) and generation
    "at-the-refresh-after-a-checkpoint": lambda out: (out / "checkpoints" / "step_00000004" / STATE).exists(),
}


RESUME_SAYS = {  # what the run resumed after each kill point says: no checkpoint yet, or the one it continues from
    # (the first save may finish its rename between the poll and the kill)
    "before-any-checkpoint": ("no complete checkpoint",),
    "during-the-first-checkpoint-write": ("no complete checkpoint", "resumed from"),
    "at-the-refresh-after-a-checkpoint": ("resumed from",),
}


def test_a_run_killed_anywhere_resumes_to_the_uninterrupted_metrics(tmp_path, uninterrupted):
    """One run killed -9 at each point in turn, each time resumed with --resume (the resumed run is the next one
    killed): every step is logged once, with the uninterrupted run's loss and reward (deterministic CPU run,
    save_every a multiple of v), and each resume says where it continued from. One process per kill point, where a
    run per point took two."""
    out = tmp_path / "killed"
    killed_at = None  # the kill point the run now starting resumes after
    for point in [*KILL_POINTS, None]:  # None: the last resume runs to the end
        log = tmp_path / f"run-killed-at-{point}.log"
        resume = [] if killed_at is None else ["train.resume=true"]
        with open(log, "w") as stderr:
            proc = subprocess.Popen(train_cmd(1, out, *COMMON, *resume), cwd=REPO, env=train_env(),
                                    stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
            if point is None:
                assert proc.wait(timeout=600) == 0, log.read_text()[-4000:]
            else:
                deadline = time.time() + 600
                while not KILL_POINTS[point](out):
                    assert proc.poll() is None and time.time() < deadline, f"the run ended before {point}"
                    time.sleep(0.02)
                kill_tree(proc.pid)
                proc.wait()
        if killed_at is not None:
            said = log.read_text()
            assert any(s in said for s in RESUME_SAYS[killed_at]), (
                killed_at, [line for line in said.splitlines() if "resum" in line or "checkpoint" in line])
        killed_at = point
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(6))  # every step once: the re-done ones replaced
    for got, want in zip(records, uninterrupted):
        assert (got["loss"], got["reward_mean"]) == (want["loss"], want["reward_mean"]), f"step {got['step']}"
    assert not list((out / "checkpoints").glob("*.tmp"))


@pytest.mark.parametrize("prompts", [3, 1])
def test_a_dp2_run_with_prompts_not_a_multiple_of_dp_trains(tmp_path, prompts):
    """The issue's command (torchrun DP 2, rollout.prompts_per_step=3; 1: a rank with no group) runs every step."""
    records = run_train(2, tmp_path, f"rollout.prompts_per_step={prompts}", "train.steps=2")
    assert [r["step"] for r in records] == [0, 1] and all(math.isfinite(r["loss"]) for r in records)


def _train(out, *overrides: str) -> subprocess.CompletedProcess:
    """`offgrpo train` in one process (no torchrun: its exit code is the command's own)."""
    return subprocess.run(train_cmd(1, out, *overrides), cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=600)


def test_a_run_directory_is_never_reused_silently_and_a_resume_says_what_it_continues(tmp_path):
    out = tmp_path / "run"
    assert _train(out, "train.steps=2", "train.save_every=2").returncode == 0
    again = _train(out, "train.steps=2")
    assert again.returncode == 2 and "holds an earlier run (metrics.jsonl)" in again.stderr, again.stderr[-2000:]
    assert "Traceback" not in again.stderr and len(metrics(out)) == 2
    # extending the finished run: the schedule is re-planned (megatron's default kept the decayed lr 0)
    extended = _train(out, "train.steps=4", "train.resume=true")
    assert extended.returncode == 0, extended.stderr[-4000:]
    assert "resumed from" in extended.stderr and "re-planned from step 2" in extended.stderr
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[2]["lr"] > 1e-4  # cosine over 4 steps, at 3
    assert records[2]["wall_s"] >= records[1]["wall_s"]
    # a new run with train.overwrite=true: the earlier one is moved aside, whole
    assert _train(out, "train.steps=1", "train.overwrite=true").returncode == 0
    [aside] = tmp_path.glob("run.replaced-*")
    assert [r["step"] for r in metrics(aside)] == [0, 1, 2, 3] and [r["step"] for r in metrics(out)] == [0]
