"""Whole-job gradient checks under torchrun (gloo), split from tests/train/test_e2e.py so the suite's two workers
share them (a file is one unit of work): the trainer's step against the reference loss (tests/workers/
train_grad_worker.py), on-policy v = 1 against GRPO and the non-finite skip (train_worker.py), and packed against
padded micro-batches over TP, SP, PP and DP (train_pack_worker.py)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, run_torchrun

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _matched(stdout: str, start: str, part: str) -> bool:
    """Whether a line of the worker's output starts with ``start`` and names ``part``."""
    return any(line.startswith(start) and part in line for line in stdout.splitlines())


def test_v1_exact_behavior_update_equals_on_policy_grpo_and_nonfinite_steps_are_skipped(tmp_path):
    proc = run_torchrun(REPO / "tests" / "workers" / "train_worker.py", 1, [str(tmp_path)])
    assert "IDENTICAL" in proc.stdout and "SKIPPED non-finite step" in proc.stdout
    assert "IDENTICAL cispo" in proc.stdout and "IDENTICAL gspo" in proc.stdout


def test_step_gradient_equals_reference_loss_over_micro_batches_and_dp(tmp_path):
    """Both layouts (padded, packed) and both aggregations in one job: one set-up and rollout, then each layout's
    micro-batches with each aggregation's objective (the only things they change) against the reference."""
    proc = run_torchrun(REPO / "tests" / "workers" / "train_grad_worker.py", 2,
                        [str(tmp_path), "token_mean,seq_mean_token_mean", "padded,packed"])
    for packed in (False, True):
        for aggregation in ("token_mean", "seq_mean_token_mean"):
            assert _matched(proc.stdout, "MATCH dp=2 ", f"packed={packed} aggregation={aggregation}"), (
                proc.stdout[-2000:])


def test_groups_dealt_unevenly_over_dp_give_the_whole_batchs_gradient(tmp_path):
    """rollout.prompts_per_step=3 over DP 2 (groups dealt 2 and 1): the step's gradient is still the whole batch's
    (was an IndexError at step 0). One group over DP 2 (1 and none) has no reward variance in this task: its
    dealing is tests/train/test_packing.py's, its run the next test's."""
    proc = run_torchrun(REPO / "tests" / "workers" / "train_grad_worker.py", 2,
                        [str(tmp_path), "token_mean", "padded,packed", "rollout.prompts_per_step=3"])
    for packed in (False, True):  # both layouts in one job, as above
        assert _matched(proc.stdout, "MATCH dp=2 groups=3 ", f"packed={packed} "), proc.stdout[-2000:]


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pp=2"], []], ids=["tp2", "tp2-sp", "pp2", "dp2"])
def test_packed_gradient_equals_padded(tmp_path, layout):
    """Packed and shared-prompt micro-batches give the padded layout's gradient (tests/workers/train_pack_worker.py),
    with token_mean and seq_mean_token_mean aggregation in each job."""
    proc = run_torchrun(REPO / "tests" / "workers" / "train_pack_worker.py", 2, [str(tmp_path), *layout])
    for aggregation in ("token_mean", "seq_mean_token_mean"):  # packed and shared-prompt, each against padded
        assert f"aggregation={aggregation} micro-batches" in proc.stdout and "shared=" in proc.stdout, (
            proc.stdout[-2000:])
