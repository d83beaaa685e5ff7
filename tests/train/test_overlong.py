"""DAPO's overlong shaping on the real rollout side (tiny Qwen2, transformers engine, real tokenizer and prompts), and
overlong filtering (``rollout.mask_truncated``) in a short `offgrpo train` run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_offgrpo.algo import overlong_penalty
from megatron_offgrpo.config import load_config
from megatron_offgrpo.sampler._rollout_side import RolloutSide, sample_metrics
from tests.helpers import REPO
from tests.train.conftest import TINY, metrics, run_train, train_env


def _batch(tiny_hf_dir, tmp_path, *overrides: str):
    config = load_config(None, [*TINY, f"train.out_dir={tmp_path}", *overrides])
    side = RolloutSide.build(config, tiny_hf_dir, tmp_path, max_positions=512)
    try:
        return side.maker.generate(0).samples
    finally:
        side.close()


def test_overlong_shaping_adds_the_length_penalty_and_accuracy_reads_the_task_score(tiny_hf_dir, tmp_path):
    plain = _batch(tiny_hf_dir, tmp_path / "plain")
    shaped = _batch(tiny_hf_dir, tmp_path / "shaped", "rollout.overlong_buffer=4", "rollout.overlong_penalty=0.5")
    assert [s.response_ids for s in plain] == [s.response_ids for s in shaped]  # same seed: same completions
    lengths = [len(s.response_ids) for s in shaped]
    assert max(lengths) > 4, "want completions that reach into the buffer (max_new_tokens=8)"
    for before, after in zip(plain, shaped):
        expected = overlong_penalty(len(after.response_ids), 8, 4, 0.5)
        assert after.shaping == pytest.approx(expected) and after.reward == pytest.approx(before.reward + expected)
    assert any(s.shaping < 0 for s in shaped)
    metrics = sample_metrics(shaped, 0, 0)
    assert metrics["accuracy"] == sample_metrics(plain, 0, 0)["accuracy"]  # the task's score, shaping left out
    assert metrics["overlong_penalty_mean"] == pytest.approx(sum(s.shaping for s in shaped) / len(shaped))
    assert metrics["truncated_fraction"] == pytest.approx(sum(s.finish_reason == "length" for s in shaped) / 16)


@pytest.mark.slow
def test_mask_truncated_leaves_cut_responses_out_of_the_loss(tmp_path):
    # 2-token limit: (nearly) every response of the random tiny model is cut, so (nearly) nothing enters the loss
    common = ["rollout.max_new_tokens=2", "train.steps=2"]
    masked = run_train(1, tmp_path / "masked", *common, "rollout.mask_truncated=true")
    kept = run_train(1, tmp_path / "kept", *common)
    for m, k in zip(masked, kept):
        assert m["truncated_fraction"] == k["truncated_fraction"] > 0
        if m["truncated_fraction"] == 1.0:
            assert m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert any(m["loss"] != k["loss"] for m, k in zip(masked, kept))


@pytest.mark.slow
def test_gspo_trains_through_micro_batches_without_a_valid_token(tmp_path):
    # issue 35's command (every response cut at 2 tokens and masked: no micro-batch has a valid token), made cheap:
    # the transformers engine, 2 x 2 answers a step, no evaluation; it stopped with "objective='gspo' needs
    # seq_log_ratio" at step 0
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_offgrpo.cli", "train", "--config", "configs/tiny-cpu.yaml",
           "model.hf_path=megatron_offgrpo/assets/tiny-qwen2", "model.init=random", "algo.objective=gspo",
           "algo.aggregation=seq_mean_token_mean", "rollout.max_new_tokens=2", "rollout.mask_truncated=true",
           "train.steps=2", "rollout.engine=transformers", "rollout.prompts_per_step=2", "rollout.group_size=2",
           "train.eval_every=0", "train.save_every=0", f"train.out_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = metrics(out)
    assert [m["step"] for m in steps] == [0, 1] and all(m["truncated_fraction"] == 1.0 for m in steps)
    assert all(m["loss"] == 0.0 and m["grad_norm"] == 0.0 for m in steps)  # nothing valid: no update, no NaN


def test_sample_metrics_give_the_spread_of_the_rewards():
    from megatron_offgrpo.data import Sample

    samples = [Sample(f"p{i}", 0, [1], [2, 3], [0.0, 0.0], 0, "stop", reward=r) for i, r in enumerate([1.0, 0, 0, 0])]
    metrics = sample_metrics(samples, 0, 0)
    # mean 0.25; population std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875)
    assert metrics["reward_mean"] == 0.25 and metrics["reward_std"] == pytest.approx(0.1875 ** 0.5)


def test_sample_metrics_count_the_samples_of_resent_groups():
    from megatron_offgrpo.data import Sample

    samples = [Sample(f"p{i}", i // 2, [1], [2], [0.0], 0, "stop", reward=0.0, attempts=a)
               for i, a in enumerate([1, 1, 2, 2, 1, 1, 3, 3])]
    assert sample_metrics(samples, 0, 0)["resent_fraction"] == 0.5  # groups 1 and 2 of 4 were sent again
