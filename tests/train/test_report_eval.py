"""`offgrpo report` draws and summarises a run's metrics; `offgrpo eval` scores a HF model on the eval split."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, save_hf_model


def test_report_summary_and_plot(tmp_path):
    from megatron_offgrpo.train.report import make_report, summary

    lines = []
    for step in range(10):
        lines.append(json.dumps({"step": step, "wall_s": 6.0 * (step + 1), "reward_mean": step / 10,
                                 "accuracy": step / 20, "time_generate_s": 3.0, "time_sync_s": 1.0,
                                 "time_train_s": 2.0, **({"eval_accuracy": 0.5} if step == 9 else {})}))
    lines.append(lines[3].replace('"reward_mean": 0.3', '"reward_mean": 0.35'))  # step 3 logged again after a resume
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    text = summary(tmp_path)
    # first fifth = steps 0-1 (rewards 0, 0.1), last fifth = steps 8-9 (0.8, 0.9); time 3:1:2 of 6 s
    assert text.startswith("10 steps: reward 0.050 -> 0.850") and "generate 50%, sync 17%, train 33%" in text
    png = make_report(tmp_path)
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_eval_cli_scores_a_model(tmp_path):
    from tests.helpers import tiny_hf_config

    cfg = dict(tiny_hf_config("qwen2"), vocab_size=151936, hidden_size=64, num_hidden_layers=1, eos_token_id=151645)
    model = save_hf_model(cfg, tmp_path / "model")
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
    assert 1 <= result["eval_response_len"] <= 4
