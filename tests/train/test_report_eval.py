"""`offgrpo report` draws and summarises a run's metrics; `offgrpo eval` scores a HF model on the eval split."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, save_hf_model


def test_report_summary_and_plot(tmp_path):
    from megatron_offgrpo.cli.report import make_report, summary

    lines = []
    for step in range(10):
        lines.append(json.dumps({"step": step, "wall_s": 6.0 * (step + 1), "reward_mean": step / 10,
                                 "accuracy": step / 20, "time_generate_s": 3.0, "time_sync_s": 1.0,
                                 "time_train_s": 2.0, **({"eval_accuracy": 0.5} if step == 9 else {})}))
    lines.append(lines[3].replace('"reward_mean": 0.3', '"reward_mean": 0.35'))  # step 3 logged again after a resume
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = summary(tmp_path)
    # first fifth = steps 0-1 (rewards 0, 0.1), last fifth = steps 8-9 (0.8, 0.9); time 3:1:2 of 6 s
    assert text.startswith("10 steps in 1.0 min: reward 0.050 -> 0.850") and "generate 50%, sync 17%, train 33%" in text
    png = make_report(tmp_path)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_report_compares_runs_and_names_held_out_accuracy(tmp_path):
    """Two runs side by side (v read from the versions), greedy accuracy before the first update and after the last."""
    from megatron_offgrpo.cli.report import summary

    for v in (1, 4):
        records = [{"step": s, "wall_s": 3.0 * (s + 1), "reward_mean": 0.5, "policy_version": s - s % v,
                    **({"eval_start_accuracy": 0.1} if s == 0 else {}), **({"eval_accuracy": 0.8} if s == 7 else {})}
                   for s in range(8)]
        (tmp_path / f"v{v}").mkdir()
        (tmp_path / f"v{v}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert "greedy held-out accuracy 0.100 (step 0) -> 0.800 (step 8)" in summary(tmp_path / "v4")
    out = tmp_path / "both.png"
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "report", str(tmp_path / "v1"),
                           str(tmp_path / "v4"), "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", proc.stderr[-2000:]
    assert proc.stdout.count("greedy held-out accuracy 0.100") == 2


def test_report_without_metrics_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "report", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "metrics.jsonl" in proc.stderr


def _one_layer_model(out):
    """A one-layer Qwen2 with the real vocabulary, saved as a HF directory."""
    from tests.helpers import tiny_hf_config

    cfg = dict(tiny_hf_config("qwen2"), vocab_size=151936, hidden_size=64, num_hidden_layers=1, eos_token_id=151645)
    return save_hf_model(cfg, out)


def test_eval_cli_scores_a_model(tmp_path):
    model = _one_layer_model(tmp_path / "model")
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_offgrpo.cli", "eval", "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
         "--model", str(model), "--prompts", "3", "--engine", "transformers", "--out", str(out),
         "rollout.max_new_tokens=4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["eval_prompts"] == 3 and result["dataset"] == "arithmetic" and 0 <= result["eval_accuracy"] <= 1
    assert result["eval_overlap"] == 0 and result["eval_source"] == "the arithmetic task's held-out questions"
    assert 1 <= result["eval_response_len"] <= 4


def test_eval_cli_samples_give_pass_at_k(tmp_path):
    model = _one_layer_model(tmp_path / "model")
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_offgrpo.cli", "eval", "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
         "--model", str(model), "--prompts", "3", "--samples", "4",
         "--engine", "transformers", "--out", str(out), "rollout.max_new_tokens=4", "rollout.temperature=1.5"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"eval_accuracy", "eval_pass@1", "eval_pass@2", "eval_pass@4", "eval_avg@4"} <= set(result)
    assert 0 <= result["eval_pass@1"] <= result["eval_pass@2"] <= result["eval_pass@4"] <= 1
    bad = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "eval", "--config",
                          str(REPO / "configs" / "tiny-cpu.yaml"), "--samples", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "train.eval_samples" in bad.stderr and bad.stderr.strip().count("\n") <= 1


@pytest.mark.slow
def test_train_evaluates_before_the_first_update_and_the_trained_policy_at_the_end(tmp_path):
    """train.eval_every: greedy accuracy of version 0 before any update, of the engine's version every N steps, and
    of the trained policy itself after the last step (pushed to the engine for it, though v=2 would not refresh)."""
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_offgrpo.cli", "train", "--config", str(REPO / "configs" / "tiny-cpu.yaml"),
         f"model.hf_path={REPO / 'megatron_offgrpo/assets/tiny-qwen2'}", "model.init=random",
         "rollout.engine=transformers", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4",
         "rollout.refresh_every=2", "train.steps=3", "train.eval_every=1", "train.eval_prompts=3",
         "train.eval_samples=2", f"train.out_dir={run}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONPATH=str(REPO)),  # this tree's package, not whichever is installed
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("eval_start_version") for r in records] == [0, None, None]
    # after steps 1 and 2 the engine still serves version 0 (v=2 refreshes before step 3); after step 3: version 3
    assert [r["eval_version"] for r in records] == [0, 0, 3] and all(r["eval_prompts"] == 3 for r in records)
    # held out: the 3 prompts evaluated are of the arithmetic task's held-out questions, none trained on
    data = json.loads((run / "run_info.json").read_text())["data"]
    assert (data["eval_size"], data["eval_overlap"], data["train_size"]) == (3, 0, 2000), data
    assert "eval_start_pass@2" in records[0] and all({"eval_pass@1", "eval_pass@2", "eval_avg@2"} <= set(r)
                                                     for r in records)
    from megatron_offgrpo.cli.report import summary

    assert "pass@2" in summary(run)
    assert (run / "hf" / "config.json").exists()
    # the end-of-run summary, once, naming the held-out accuracy before and after and where the run is
    assert proc.stdout.count("run summary: 3 steps in") == 1, proc.stdout
    assert "greedy held-out accuracy" in proc.stdout and "; pass@2 " in proc.stdout
    assert f"in {run}: policy (HF) hf/, checkpoint checkpoints/step_00000003/" in proc.stdout
    assert f"plots: offgrpo report {run}" in proc.stdout
    written = json.loads((run / "summary.json").read_text())
    assert written["steps"] == 3 and written["pass_metric"] == "pass@2"
    assert written["locations"]["hf"] == str(run / "hf")
