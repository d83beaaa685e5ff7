"""What each panel of ``offgrpo report`` shows, as data: curves read from a run's step records (``metrics.jsonl``),
without matplotlib. A panel names the metrics it reads; a run that logged none of them gets no curve there.

Families of keys are read by pattern (every ``clip*_fraction``, every ``response_len*``, every ``entropy*``), so a
metric added to the trainer later appears in its panel without a change here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable

from megatron_offgrpo.runlog import eval_points, pass_points

TIME_PARTS = (("time_generate_s", "generate"), ("time_sync_s", "weight sync"), ("time_train_s", "train"))
"""The parts of a step's time, bottom to top of the stacked bars."""


@dataclasses.dataclass
class Curve:
    """One line of a panel.

    Attributes:
        name: what it shows (the metric, or a description for evaluations).
        step: x as the optimizer step (evaluations: the steps done when evaluated).
        wall: x as wall-clock minutes of the training loop.
        y: the values (moving-averaged for per-step metrics).
        band: (low, high) drawn as a shaded band around the curve, or None.
        style: a matplotlib format ("-" per-step metrics, "o--" greedy evaluations, "s:" pass@k).
        right: drawn on the panel's second y axis.
    """

    name: str
    step: list[float]
    wall: list[float]
    y: list[float]
    band: tuple[list[float], list[float]] | None = None
    style: str = "-"
    right: bool = False


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metric_curve(records: list[dict], key: str, window: int, right: bool = False) -> Curve | None:
    """``key`` against step and wall-clock over the records that hold it as a finite number (None if none does)."""
    rows = [r for r in records if _number(r.get(key))]
    if not rows:
        return None
    return Curve(key, [r["step"] for r in rows], [r["wall_s"] / 60 for r in rows],
                 smooth([r[key] for r in rows], window), right=right)


def keys_like(records: list[dict], match: Callable[[str], bool]) -> list[str]:
    """The numeric metric keys of the records that ``match``, sorted."""
    return sorted({k for r in records for k, v in r.items() if match(k) and _number(v)})


def _curves(records: list[dict], keys: list[str], window: int, right: bool = False) -> list[Curve]:
    return [c for c in (metric_curve(records, k, window, right) for k in keys) if c is not None]


def reward_curves(records: list[dict], window: int) -> list[Curve]:
    """``reward_mean`` with a band of +- ``reward_std`` (the spread of the step's rewards) when logged."""
    curve = metric_curve(records, "reward_mean", window)
    if curve is None:
        return []
    rows = [r for r in records if _number(r.get("reward_mean"))]
    if all(_number(r.get("reward_std")) for r in rows):
        std = smooth([r["reward_std"] for r in rows], window)
        curve.band = ([m - s for m, s in zip(curve.y, std)], [m + s for m, s in zip(curve.y, std)])
    return [curve]


def _eval_curves(records: list[dict]) -> list[Curve]:
    """Greedy held-out accuracy at each evaluation, and the largest pass@k when the evaluations sampled."""
    curves = []
    if points := eval_points(records):
        curves.append(Curve("greedy held-out accuracy", *map(list, zip(*points)), style="o--"))
    metric, points = pass_points(records)
    if points:
        curves.append(Curve(f"held-out {metric}", *map(list, zip(*points)), style="s:"))
    return curves


def accuracy_curves(records: list[dict], window: int) -> list[Curve]:
    """Sampled ``accuracy`` per step, greedy held-out accuracy and pass@k at the evaluations."""
    return _curves(records, ["accuracy"], window) + _eval_curves(records)


def progress_curves(records: list[dict], window: int) -> list[Curve]:
    """Reward and held-out accuracy together: the panel drawn against the other x (wall-clock by default)."""
    return _curves(records, ["reward_mean"], window) + _eval_curves(records)


def reward_model_curves(records: list[dict], window: int) -> list[Curve]:
    """Beside a reward model: the gold (rule) reward of the sampled completions and the greedy held-out accuracy
    (left), the model's mean score of each (right: its scale is the model's). Where the model's rise and the gold's
    do not, the policy is over-optimising the model. [] without one."""
    if not any("reward_model_mean" in r for r in records):
        return []
    curves = _curves(records, ["reward_gold_mean"], window)
    if points := eval_points(records):
        curves.append(Curve("gold: greedy held-out accuracy", *map(list, zip(*points)), style="o--"))
    curves += _curves(records, ["reward_model_mean"], window, right=True)
    if held_out := eval_points(records, "reward_model"):
        curves.append(Curve("model: held-out score", *map(list, zip(*held_out)), style="s:", right=True))
    return curves


def staleness_curves(records: list[dict], window: int) -> list[Curve]:
    """``staleness_mean`` and ``staleness_max`` (steps), ``token_staleness_mean`` when a refresh came in the middle
    of samples (partial rollouts), and ``policy_version`` on the second axis; unsmoothed: the saw-tooth of every v
    steps is the point (``window`` unused)."""
    partial = any(_number(r.get("partial_fraction")) and r["partial_fraction"] > 0 for r in records)
    keys = ["staleness_mean", "staleness_max"] + (["token_staleness_mean"] if partial else [])
    return _curves(records, keys, 1) + _curves(records, ["policy_version"], 1, right=True)


def clip_curves(records: list[dict], window: int) -> list[Curve]:
    """Every clip fraction the objective logs: ``clip_fraction``, ``clip_low/high_fraction``, ``dual_clip_fraction``."""
    return _curves(records, keys_like(records, lambda k: "clip" in k and k.endswith("_fraction")), window)


def entropy_curves(records: list[dict], window: int) -> list[Curve]:
    """Every ``entropy*`` metric (the policy's mean token entropy), and with on-policy distillation ``teacher_kl``
    (the per-token reverse KL to the teacher), both in nats."""
    return _curves(records, keys_like(records, lambda k: k.startswith("entropy") or k == "teacher_kl"), window)


def length_curves(records: list[dict], window: int) -> list[Curve]:
    """Every ``response_len*`` metric (mean, percentiles, max, ...), ``truncated_fraction`` on the second axis."""
    return (_curves(records, keys_like(records, lambda k: k.startswith("response_len")), window)
            + _curves(records, ["truncated_fraction"], window, right=True))


def mismatch_curves(records: list[dict], window: int) -> list[Curve]:
    """The trainer / behavior log-prob mismatch over the tokens in the loss, before the step's update:
    ``log_ratio_abs_mean`` (mean |trainer - behavior log-prob|; at staleness 0 the trainer / engine numerical
    mismatch, else also the policy's change since the samples' version), and on the right axis, when the run
    recomputes the behavior log-probs (``rollout.behavior_logprobs=recompute``: ``tis_raw_mean`` is not 1 throughout),
    ``tis_raw_mean``, the mean of exp(recomputed - fleet log-prob), with [``tis_raw_min``, ``tis_raw_max``] as the
    band. A step with no token in the loss logs 0 for every one of them: left out."""
    rows = [r for r in records if _number(r.get("tis_raw_mean")) and r["tis_raw_mean"] > 0]
    curves = [c for c in [metric_curve(rows, "log_ratio_abs_mean", window)] if c is not None]
    if rows and any(abs(r["tis_raw_mean"] - 1.0) > 1e-12 for r in rows):
        ratio = metric_curve(rows, "tis_raw_mean", window, right=True)
        if all(_number(r.get("tis_raw_min")) and _number(r.get("tis_raw_max")) for r in rows):
            ratio.band = ([r["tis_raw_min"] for r in rows], [r["tis_raw_max"] for r in rows])
        curves.append(ratio)
    return curves


def utilisation_curves(records: list[dict], window: int) -> list[Curve]:
    """Per step, the share of its wall time (between consecutive ``wall_s``) that the trainer trained
    (``time_train_s``) and that generation ran (``generate_s``: beside the trainer in ``rollout.mode`` overlap,
    async or async_partial, so both can be near 1), and ``buffer_depth`` (async: batches ready behind the step's) on
    the second axis."""
    shares = []
    for before, row in zip(records, records[1:]):
        seconds = row.get("wall_s", 0) - before.get("wall_s", 0)
        if seconds > 0:
            shares.append({"step": row["step"], "wall_s": row["wall_s"],
                           **{name: min(row[key] / seconds, 1.0) for key, name in
                              (("time_train_s", "trainer busy"), ("generate_s", "generation busy"))
                              if _number(row.get(key))}})
    return (_curves(shares, ["trainer busy", "generation busy"], window)
            + _curves(records, ["buffer_depth"], 1, right=True))


def time_split(records: list[dict]) -> dict[str, list[float]]:
    """Seconds of each step spent per part (``TIME_PARTS``' labels; 0 where a step logged none)."""
    return {label: [r.get(key, 0.0) for r in records] for key, label in TIME_PARTS}


@dataclasses.dataclass(frozen=True)
class Panel:
    """One panel of the report: its title, y labels, the metrics it reads (for "not logged") and its curves."""

    title: str
    ylabel: str
    reads: str
    curves: Callable[[list[dict], int], list[Curve]]
    right_label: str = ""
    ylim: tuple[float, float] | None = None


UNIT = (-0.02, 1.02)
PANELS = (
    Panel("reward (+- std of the step's rewards)", "sampled reward", "reward_mean, reward_std", reward_curves),
    Panel("accuracy: sampled, greedy held-out, pass@k", "accuracy", "accuracy, eval_accuracy, eval_pass@k",
          accuracy_curves, ylim=UNIT),
    Panel("reward and held-out accuracy", "reward / accuracy", "reward_mean, eval_accuracy", progress_curves),
    Panel("reward model against the gold reward", "gold reward / accuracy",
          "reward_gold_mean, eval_accuracy, reward_model_mean, eval_reward_model", reward_model_curves,
          right_label="reward model's score"),
    Panel("staleness and policy version", "staleness (steps)", "staleness_mean, staleness_max, policy_version",
          staleness_curves, right_label="policy version"),
    Panel("clip fractions", "fraction of the loss tokens", "clip*_fraction", clip_curves),
    Panel("entropy (and reverse KL to the teacher)", "nats per token", "entropy_mean, teacher_kl", entropy_curves),
    Panel("response length", "tokens", "response_len*, truncated_fraction", length_curves,
          right_label="truncated fraction"),
    Panel("trainer / behavior log-prob mismatch", "|trainer - behavior log-prob| (nats)",
          "log_ratio_abs_mean, tis_raw_mean, tis_raw_min/max", mismatch_curves,
          right_label="exp(recomputed - fleet log-prob)"),
    Panel("utilisation: busy share of each step", "share of the step's wall time",
          "time_train_s, generate_s, buffer_depth", utilisation_curves, right_label="batches ready (async)",
          ylim=UNIT),
)
"""The report's curve panels in grid order; the time split (``time_split``) is drawn last."""


def mean_records(runs: list[list[dict]]) -> list[dict]:
    """The step-by-step mean of several runs (seeds of one variant) as one run's records: step i of the result holds
    the mean of every numeric key that all runs hold at their step i, over as many steps as the shortest run."""
    if len(runs) == 1:
        return runs[0]
    out = []
    for rows in zip(*runs):
        keys = set.intersection(*({k for k, v in r.items() if _number(v)} for r in rows))
        out.append({k: statistics.fmean(r[k] for r in rows) for k in keys} | {"step": rows[0]["step"]})
    return out
