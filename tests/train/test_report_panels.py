"""`offgrpo report`'s panels as data: each panel's curves hold what the step records hold (window 1: no averaging),
families of keys are found by pattern, what a run did not log is left out, several runs are overlaid and seeds are
averaged step by step."""

from __future__ import annotations

import json
import math

import pytest

from megatron_offgrpo.cli import _panels as panels
from megatron_offgrpo.cli.report import main, make_report, mean_records, plot_runs


def _step(s: int, reward: float, **extra) -> dict:
    return {"step": s, "wall_s": 30.0 * (s + 1), "reward_mean": reward, **extra}


def _full(steps: int = 4) -> list[dict]:
    """Every metric the panels read, with 0/1 rewards (a quarter of 4 samples right: std sqrt(0.25 * 0.75))."""
    return [_step(s, 0.25, reward_std=math.sqrt(0.1875), accuracy=0.25, staleness_mean=0.5 * (s % 2),
                  staleness_max=s % 2, policy_version=s - s % 2, clip_fraction=0.1 * s, clip_low_fraction=0.0,
                  clip_high_fraction=0.1 * s, dual_clip_fraction=0.0, tis_truncated_fraction=0.5, entropy_mean=2.0 - s,
                  response_len=5.0 + s, response_length_p90=9.0, truncated_fraction=0.25,
                  tis_raw_mean=0.0 if s == 0 else 1.0 + s / 100, tis_raw_min=0.0 if s == 0 else 0.9,
                  tis_raw_max=0.0 if s == 0 else 1.5, log_ratio_abs_mean=0.0 if s == 0 else 1e-3 * s,
                  time_generate_s=3.0, time_sync_s=1.0 * (s % 2 == 0),
                  time_train_s=2.0, generate_s=27.0, buffer_depth=s % 3,
                  **({"eval_start_accuracy": 0.1, "eval_start_pass@4": 0.4} if s == 0 else {}),
                  **({"eval_accuracy": 0.6, "eval_pass@4": 0.9} if s == steps - 1 else {}))
            for s in range(steps)]


def _by_name(curves) -> dict:
    return {c.name: c for c in curves}


def test_reward_has_its_spread_band_and_accuracy_its_own_panel():
    records = _full()
    [reward] = panels.reward_curves(records, 1)
    assert reward.name == "reward_mean" and reward.y == [0.25] * 4 and reward.step == [0, 1, 2, 3]
    assert reward.wall == [0.5, 1.0, 1.5, 2.0]  # minutes
    assert reward.band[0] == pytest.approx([0.25 - 0.4330127] * 4) and reward.band[1] == pytest.approx([0.6830127] * 4)
    accuracy = _by_name(panels.accuracy_curves(records, 1))
    assert list(accuracy) == ["accuracy", "greedy held-out accuracy", "held-out pass@4"]
    assert accuracy["greedy held-out accuracy"].step == [0, 4] and accuracy["greedy held-out accuracy"].y == [0.1, 0.6]
    assert accuracy["greedy held-out accuracy"].wall == [0.0, 2.0] and accuracy["held-out pass@4"].y == [0.4, 0.9]
    assert accuracy["greedy held-out accuracy"].style == "o--" and accuracy["held-out pass@4"].style == "s:"
    progress = _by_name(panels.progress_curves(records, 1))  # the panel drawn against the other x
    assert list(progress) == ["reward_mean", "greedy held-out accuracy", "held-out pass@4"]


def test_families_of_keys_are_found_by_pattern():
    records = _full()
    clips = _by_name(panels.clip_curves(records, 1))
    assert list(clips) == ["clip_fraction", "clip_high_fraction", "clip_low_fraction", "dual_clip_fraction"]
    assert clips["clip_fraction"].y == pytest.approx([0.0, 0.1, 0.2, 0.3])
    lengths = _by_name(panels.length_curves(records, 1))  # a new response_length_* metric appears by itself
    assert list(lengths) == ["response_len", "response_length_p90", "truncated_fraction"]
    assert lengths["truncated_fraction"].right and not lengths["response_len"].right
    assert _by_name(panels.entropy_curves(records, 1))["entropy_mean"].y == [2.0, 1.0, 0.0, -1.0]
    distilled = [dict(r, teacher_kl=0.5 / (i + 1)) for i, r in enumerate(records)]  # on-policy distillation's KL
    assert _by_name(panels.entropy_curves(distilled, 1))["teacher_kl"].y == pytest.approx([0.5, 0.25, 0.5 / 3, 0.125])
    staleness = _by_name(panels.staleness_curves(records, 5))  # never averaged: the saw-tooth of v is the point
    assert staleness["staleness_max"].y == [0, 1, 0, 1] and staleness["policy_version"].y == [0, 0, 2, 2]
    assert staleness["policy_version"].right


def test_utilisation_is_each_steps_busy_share_of_its_wall_time():
    shares = _by_name(panels.utilisation_curves(_full(), 1))  # steps 30 s apart: 2 s training, 27 s generating
    assert shares["trainer busy"].step == [1, 2, 3] and shares["trainer busy"].y == pytest.approx([2 / 30] * 3)
    assert shares["generation busy"].y == pytest.approx([0.9] * 3) and not shares["generation busy"].right
    assert shares["buffer_depth"].right and shares["buffer_depth"].y == [0, 1, 2, 0]
    lockstep = [{k: v for k, v in r.items() if k != "buffer_depth"} for r in _full()]
    assert sorted(_by_name(panels.utilisation_curves(lockstep, 1))) == ["generation busy", "trainer busy"]


def test_the_mismatch_leaves_out_steps_with_no_token_in_the_loss():
    gap, ratio = panels.mismatch_curves(_full(), 1)  # behavior recomputed: its ratio to the fleet's on the right
    assert gap.name == "log_ratio_abs_mean" and not gap.right
    assert gap.step == [1, 2, 3] and gap.y == pytest.approx([1e-3, 2e-3, 3e-3])  # step 0 logged 0: nothing counted
    assert ratio.right and ratio.y == pytest.approx([1.01, 1.02, 1.03]) and ratio.band == ([0.9] * 3, [1.5] * 3)
    fleet_behavior = [dict(r, tis_raw_mean=1.0 if r["tis_raw_mean"] else 0.0) for r in _full()]
    assert [c.name for c in panels.mismatch_curves(fleet_behavior, 1)] == ["log_ratio_abs_mean"]  # ratio 1: no curve


def test_curves_are_moving_averages_over_the_records_that_hold_the_key():
    records = [_step(0, 0.0), {"step": 1, "wall_s": 60.0}, _step(2, 1.0), _step(3, 0.5, reward_std=0.1)]
    [reward] = panels.reward_curves(records, 2)
    assert reward.step == [0, 2, 3] and reward.y == [0.0, 0.5, 0.75] and reward.band is None  # std not at every step
    assert panels.smooth([1.0, 2.0, 3.0, 4.0], 3) == [1.0, 1.5, 2.0, 3.0]


def test_a_run_without_the_metrics_has_no_curves_in_any_panel():
    bare = [{"step": 0, "wall_s": 1.0}, {"step": 1, "wall_s": 2.0, "skipped": False, "loss": float("nan")}]
    for panel in panels.PANELS:
        assert panel.curves(bare, 1) == [], panel.title
    assert panels.time_split(bare) == {"generate": [0.0, 0.0], "weight sync": [0.0, 0.0], "train": [0.0, 0.0]}
    assert panels.time_split(_full(2)) == {"generate": [3.0, 3.0], "weight sync": [1.0, 0.0], "train": [2.0, 2.0]}


def test_seeds_are_averaged_step_by_step_over_the_keys_all_of_them_hold():
    a = [_step(0, 0.0, accuracy=0.0), _step(1, 0.5, eval_accuracy=0.2), _step(2, 1.0)]
    b = [_step(0, 1.0, accuracy=1.0), _step(1, 0.5)]
    mean = mean_records([a, b])
    assert mean == [{"step": 0, "wall_s": 30.0, "reward_mean": 0.5, "accuracy": 0.5},
                    {"step": 1, "wall_s": 60.0, "reward_mean": 0.5}]  # eval_accuracy: seed b has none at step 1
    assert mean_records([a]) is a


def _write(run_dir, records) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_comparison_of_two_runs_one_without_most_metrics(tmp_path, capsys):
    full = _full(8)
    _write(tmp_path / "v2", full)
    _write(tmp_path / "bare", [_step(s, s % 2, policy_version=s) for s in range(8)])  # 0/1 rewards, v=1, no std
    png = make_report([tmp_path / "v2", tmp_path / "bare"], window=3)
    assert png == tmp_path / "v2" / "report.png" and png.read_bytes()[:4] == b"\x89PNG"
    main([str(tmp_path / "v2"), str(tmp_path / "bare"), "--x", "wall", "--out", str(tmp_path / "both.png")])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'v2'}: 8 steps in 4.0 min" in out and f"{tmp_path / 'bare'}: 8 steps" in out
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_runs_draws_labelled_groups_and_checks_its_arguments(tmp_path):
    groups = {"grpo v=1": mean_records([_full(6), _full(5)]), "grpo v=4": _full(6)}
    out = plot_runs(groups, tmp_path / "comparison.png", window=2, x="wall", title="on- vs off-policy")
    assert out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="pick one of step, wall"):
        plot_runs(groups, tmp_path / "x.png", x="time")
    with pytest.raises(ValueError, match="at least 1 step"):
        plot_runs(groups, tmp_path / "x.png", window=0)
