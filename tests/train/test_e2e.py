"""End-to-end CPU runs of the trainer under torchrun (gloo): layouts, refresh cadence, staleness, resume."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
from tests.train.conftest import metrics, run_train, train_cmd, train_env

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.mark.parametrize("tp,pp,v,overlap", [(2, 1, 1, False), (1, 2, 4, False), (1, 1, 2, True)],
                         ids=["tp2-v1", "pp2-v4", "tp1-v2-overlap"])
def test_training_runs_with_versions_and_bounded_staleness(tmp_path, tp, pp, v, overlap):
    steps = 5
    records = run_train(tp * pp, tmp_path, f"parallel.tp={tp}", f"parallel.pp={pp}", f"rollout.refresh_every={v}",
                        f"train.steps={steps}", f"rollout.overlap={str(overlap).lower()}")
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


def test_resume_after_kill_reproduces_the_uninterrupted_losses(tmp_path):
    common = ["train.steps=6", "train.save_every=2", "rollout.refresh_every=2"]
    full = run_train(1, tmp_path / "full", *common)
    # The same run, killed with SIGKILL once its step-4 checkpoint is complete, then resumed.
    out = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(1, out, *common), cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "step_00000004" / "trainer_state.json").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before its step-4 checkpoint"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    resumed = run_train(1, out, *common, "train.resume=true")
    by_step = {r["step"]: r for r in resumed}
    assert set(by_step) >= {4, 5}
    for step in (4, 5):
        assert by_step[step]["loss"] == full[step]["loss"], f"step {step}: resumed loss differs"
        assert by_step[step]["reward_mean"] == full[step]["reward_mean"]
    assert [r["step"] for r in metrics(out)] == list(range(6))  # the steps before the kill kept, none twice


def test_v1_exact_behavior_update_equals_on_policy_grpo_and_nonfinite_steps_are_skipped(tmp_path):
    from tests.helpers import run_torchrun

    proc = run_torchrun(REPO / "tests" / "workers" / "train_worker.py", 1, [str(tmp_path)])
    assert "IDENTICAL" in proc.stdout and "SKIPPED non-finite step" in proc.stdout


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_step_gradient_equals_reference_loss_over_micro_batches_and_dp(tmp_path, aggregation):
    from tests.helpers import run_torchrun

    proc = run_torchrun(REPO / "tests" / "workers" / "train_grad_worker.py", 2, [str(tmp_path), aggregation])
    assert "MATCH dp=2" in proc.stdout


def _train(out, *overrides: str) -> subprocess.CompletedProcess:
    """`offgrpo train` in one process (no torchrun: its exit code is the command's own)."""
    from tests.train.conftest import TINY

    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "train", *TINY, f"train.out_dir={out}",
                           *overrides], cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)


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
    # what a kill -9 during the first checkpoint save leaves: logged steps, a half-written step_X.tmp
    killed = tmp_path / "killed"
    (killed / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)
    (killed / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "wall_s": s}) + "\n" for s in (0, 1)))
    restarted = _train(killed, "train.steps=1", "train.resume=true")
    assert restarted.returncode == 0, restarted.stderr[-4000:]
    assert "no complete checkpoint" in restarted.stderr and "starting at step 0" in restarted.stderr
    assert [r["step"] for r in metrics(killed)] == [0] and not (killed / "checkpoints" / "step_00000002.tmp").exists()
