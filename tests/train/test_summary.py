"""The end-of-run summary (``offgrpo train``'s last lines, ``RUN/summary.json``, ``offgrpo report``'s line) from
step records worked by hand."""

from __future__ import annotations

import json

import pytest

from megatron_offgrpo.runlog._summary import format_summary, run_summary, write_summary
from megatron_offgrpo.runlog._summary import locations


def _records() -> list[dict]:
    """10 steps of 6 s (3 generate, 1 sync, 2 train), v = 2, evaluations before the first update, after step 5 and
    after the last, pass@1 and pass@2 at the first and the last."""
    records = []
    for s in range(10):
        r = {"step": s, "wall_s": 6.0 * (s + 1), "reward_mean": s / 10, "accuracy": s / 20, "time_generate_s": 3.0,
             "time_sync_s": 1.0, "time_train_s": 2.0, "staleness_mean": 0.5 * (s % 2), "staleness_max": s % 2,
             "policy_version": s - s % 2}
        if s == 0:
            r |= {"eval_start_accuracy": 0.1, "eval_start_pass@1": 0.2, "eval_start_pass@2": 0.3}
        if s in (4, 9):
            r |= {"eval_accuracy": 0.5 if s == 4 else 0.8}
        if s == 9:
            r |= {"eval_pass@1": 0.7, "eval_pass@2": 0.9}
        records.append(r)
    return records


def test_the_summary_of_hand_worked_records():
    s = run_summary(_records())
    assert s.steps == 10 and s.wall_min == pytest.approx(1.0)  # the last step ends at 60 s
    assert s.time_s == {"generate": 30.0, "sync": 10.0, "train": 20.0}
    assert s.time_share == pytest.approx({"generate": 0.5, "sync": 1 / 6, "train": 1 / 3})
    # first fifth = steps 0-1 (rewards 0, 0.1; accuracies 0, 0.05), last fifth = steps 8-9 (0.8, 0.9; 0.4, 0.45)
    assert s.reward == pytest.approx((0.05, 0.85)) and s.accuracy == pytest.approx((0.025, 0.425))
    assert s.held_out == (0, 0.1, 10, 0.8)  # before the first update, and after step 9 (10 done)
    assert s.pass_metric == "pass@2" and s.held_out_pass == (0.3, 0.9)  # the largest k
    assert s.staleness_mean == pytest.approx(0.25) and s.staleness_max == 1  # 0, 0.5, 0, 0.5, ...
    assert s.refreshes == 4 and s.refresh_every == 2  # versions 0 0 2 2 4 4 6 6 8 8


def test_v_is_the_most_common_gap_between_versions_whatever_a_resume_adds():
    """A v = 4 run resumed from step 13's checkpoint (SIGTERM stops at any step) refreshes once at its resume."""
    versions = [0] * 4 + [4] * 4 + [8] * 4 + [12, 13, 13, 13, 13, 17, 17, 17, 17, 21]
    records = [{"step": s, "wall_s": float(s), "policy_version": v} for s, v in enumerate(versions)]
    assert run_summary(records).refresh_every == 4


def test_what_a_run_did_not_log_is_none_not_an_error():
    s = run_summary([{"step": 0, "wall_s": 30.0}, {"step": 1, "wall_s": 60.0}])
    assert (s.reward, s.accuracy, s.held_out, s.held_out_pass, s.staleness_mean, s.refresh_every) == (None,) * 6
    assert s.time_share == {} and s.refreshes == 0
    assert s.line() == "2 steps in 1.0 min: reward not logged (first/last fifth), accuracy not logged; 0 refreshes"
    with pytest.raises(ValueError, match="no step records"):
        run_summary([])


def test_the_one_line_keeps_the_report_format():
    line = run_summary(_records()).line()
    assert line == ("10 steps in 1.0 min: reward 0.050 -> 0.850 (first/last fifth), accuracy 0.025 -> 0.425; greedy "
                    "held-out accuracy 0.100 (step 0) -> 0.800 (step 10), pass@2 0.300 -> 0.900; time: generate 50%, "
                    "sync 17%, train 33%; staleness mean 0.25 (max 1), 4 refreshes")


def test_the_end_of_run_lines_name_the_numbers_and_where_things_are(tmp_path):
    where = {"run_dir": "runs/x", "metrics": "runs/x/metrics.jsonl", "hf": "runs/x/hf",
             "checkpoint": None, "report": "offgrpo report runs/x"}
    assert format_summary(run_summary(_records()), where).splitlines() == [
        "run summary: 10 steps in 1.0 min of training loop (generate 50%, sync 17%, train 33%)",
        "  sampled reward 0.050 -> 0.850, accuracy 0.025 -> 0.425 (first -> last fifth of the steps)",
        "  greedy held-out accuracy 0.100 (step 0) -> 0.800 (step 10); pass@2 0.300 -> 0.900",
        "  staleness 0.25 steps on average (max 1); 4 weight refreshes (v=2)",
        "  in runs/x: policy (HF) hf/, checkpoint none, summary.json, metrics.jsonl",
        "  plots: offgrpo report runs/x",
    ]


def test_write_summary_puts_the_fields_and_the_locations_in_summary_json(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    from megatron_offgrpo.runlog._checkpoints import latest_checkpoint  # the newest complete checkpoint

    assert locations(tmp_path, None)["hf"] is None and locations(tmp_path, None)["checkpoint"] is None
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    done = tmp_path / "checkpoints" / "step_00000010"
    done.mkdir(parents=True)
    (done / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoints" / "step_00000012.tmp").mkdir()  # a save cut short: not a checkpoint
    summary, where = write_summary(tmp_path, latest_checkpoint(tmp_path))
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["steps"] == 10 and data["held_out"] == [0, 0.1, 10, 0.8] and data["refreshes"] == 4
    assert data["time_share"]["generate"] == pytest.approx(0.5)
    assert data["locations"] == where == {
        "run_dir": str(tmp_path), "metrics": str(tmp_path / "metrics.jsonl"), "hf": str(tmp_path / "hf"),
        "checkpoint": str(done), "report": f"offgrpo report {tmp_path}"}
    assert summary == run_summary(_records())


def test_beside_a_reward_model_the_summary_and_the_report_set_its_score_against_the_gold():
    from megatron_offgrpo.cli._panels import reward_model_curves

    records = [{"step": s, "wall_s": 6.0 * (s + 1), "reward_mean": float(s), "accuracy": 0.5 - 0.1 * s,
                "reward_model_mean": float(s), "reward_gold_mean": 0.5 - 0.1 * s} for s in range(5)]
    records[0] |= {"eval_start_accuracy": 0.4, "eval_start_reward_model": -1.0}
    records[1] |= {"eval_accuracy": 0.6, "eval_reward_model": 2.0}
    records[4] |= {"eval_accuracy": 0.2, "eval_reward_model": 5.0}
    summary = run_summary(records)
    assert summary.reward_model == (0.0, 4.0) and summary.held_out_model == (-1.0, 5.0)
    text = format_summary(summary, {"run_dir": "r", "metrics": "r/metrics.jsonl", "hf": None, "checkpoint": None,
                                    "report": "offgrpo report r"})
    assert "reward model's score 0.000 -> 4.000 sampled, -1.000 -> 5.000 held out" in text
    curves = {c.name: c for c in reward_model_curves(records, 1)}
    assert set(curves) == {"reward_gold_mean", "gold: greedy held-out accuracy", "reward_model_mean",
                           "model: held-out score"}
    assert curves["model: held-out score"].step == [0, 2, 5] and curves["model: held-out score"].right
    assert curves["gold: greedy held-out accuracy"].y == [0.4, 0.6, 0.2]
    assert reward_model_curves([{k: v for k, v in r.items() if "model" not in k} for r in records], 1) == []
