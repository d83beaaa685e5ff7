"""A run in a few numbers, computed from its step records (``metrics.jsonl``): what ``offgrpo train`` prints once at
the end (global rank 0) and writes to ``RUN/summary.json``, and what ``offgrpo report`` prints as one line a run.

No torch here: ``offgrpo report`` imports it without the trainer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_offgrpo.runlog._metrics import read_metrics

TIME_KEYS = {"generate": "time_generate_s", "sync": "time_sync_s", "train": "time_train_s"}
"""The parts of a step's time, as the summary names them -> their metric."""
SUMMARY_FILE = "summary.json"


def eval_points(records: list[dict], metric: str = "accuracy") -> list[tuple[int, float, float]]:
    """(step, wall-clock minutes, value) of ``eval_{metric}`` (greedy accuracy by default) at every evaluation, the
    one before the first update (``eval_start_{metric}``) included."""
    points = [(0, 0.0, r[f"eval_start_{metric}"]) for r in records[:1] if f"eval_start_{metric}" in r]
    return points + [(r["step"] + 1, r["wall_s"] / 60, r[f"eval_{metric}"]) for r in records if f"eval_{metric}" in r]


def pass_points(records: list[dict]) -> tuple[str, list[tuple[int, float, float]]]:
    """(the metric, its points) of the largest pass@k the evaluations report (``train.eval_samples`` > 1), as
    ``eval_points``; ("", []) when none does."""
    keys = {key.removeprefix("eval_").removeprefix("start_") for r in records for key in r
            if key.startswith(("eval_pass@", "eval_start_pass@"))}
    if not keys:
        return "", []
    metric = max(keys, key=lambda key: int(key.split("@")[1]))
    return metric, eval_points(records, metric)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a run did, from its step records. ``None``: the run did not log what the field needs.

    Attributes:
        steps: step records (a resumed run's steps counted once).
        wall_min: the training loop's wall-clock at the last step, minutes (set-up and engine start excluded).
        time_s: seconds spent generating, refreshing the engine's weights (``sync``) and training, summed over steps.
        reward: mean sampled reward over the first and the last fifth of the steps (at least one step each).
        accuracy: the same of the sampled accuracy (the task's score, shaping left out).
        reward_model, held_out_model: beside a reward model, its mean score of the sampled completions (first and
            last fifth of the steps) and of the greedy held-out ones (first and last evaluation); the accuracies
            above are then the rule's, the gold.
        held_out: greedy held-out accuracy of the first and the last evaluation, as (step, accuracy, step,
            accuracy); step 0 is the one before the first update. None with fewer than two evaluations.
        pass_metric: the largest pass@k the evaluations report ("" without ``train.eval_samples`` > 1).
        held_out_pass: that pass@k at the first and the last evaluation.
        staleness_mean: the mean over steps of the samples' mean staleness (trainer step - policy version).
        staleness_max: the largest staleness of any sample.
        refreshes: the steps whose engine served another version than the step before's (weight refreshes seen by
            the samples; the refresh for the final evaluation is not one).
        refresh_every: v, the most common gap between the versions served (None with a single version): a run
            resumed from a checkpoint between two refreshes refreshes once at its resume, one shorter gap.
    """

    steps: int
    wall_min: float
    time_s: dict[str, float]
    reward: tuple[float, float] | None
    accuracy: tuple[float, float] | None
    held_out: tuple[int, float, int, float] | None
    pass_metric: str
    held_out_pass: tuple[float, float] | None
    staleness_mean: float | None
    staleness_max: int | None
    refreshes: int
    refresh_every: int | None
    reward_model: tuple[float, float] | None = None
    held_out_model: tuple[float, float] | None = None

    @property
    def time_share(self) -> dict[str, float]:
        """Each part's fraction of the step time ({} when no step logged its times)."""
        spent = sum(self.time_s.values())
        return {part: seconds / spent for part, seconds in self.time_s.items()} if spent > 0 else {}

    def line(self) -> str:
        """The summary as one line (``offgrpo report``)."""
        text = f"{self.steps} steps in {self.wall_min:.1f} min: reward {_change(self.reward)} (first/last fifth), "
        text += f"accuracy {_change(self.accuracy)}"
        if self.held_out is not None:
            s0, a0, s1, a1 = self.held_out
            text += f"; greedy held-out accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
        if self.held_out_pass is not None:
            text += f", {self.pass_metric} {_change(self.held_out_pass)}"
        if self.time_share:
            text += "; time: " + ", ".join(f"{part} {100 * share:.0f}%" for part, share in self.time_share.items())
        stale = ("" if self.staleness_mean is None
                 else f"staleness mean {self.staleness_mean:.2f} (max {self.staleness_max}), ")
        return text + f"; {stale}{_refreshes(self.refreshes)}"


def run_summary(records: list[dict[str, Any]]) -> RunSummary:
    """The summary of a run's step records (``read_metrics``; at least one)."""
    if not records:
        raise ValueError("no step records to summarise")
    fifth = max(1, len(records) // 5)
    head, tail = records[:fifth], records[-fifth:]
    evals = eval_points(records)
    metric, passes = pass_points(records)
    versions = [r["policy_version"] for r in records if "policy_version" in r]
    served = sorted(set(versions))
    gaps = [b - a for a, b in zip(served, served[1:])]
    stale = [r["staleness_mean"] for r in records if "staleness_mean" in r]
    return RunSummary(
        steps=len(records), wall_min=records[-1].get("wall_s", 0.0) / 60,
        time_s={part: sum(r.get(key, 0.0) for r in records) for part, key in TIME_KEYS.items()},
        reward=_head_tail(head, tail, "reward_mean"), accuracy=_head_tail(head, tail, "accuracy"),
        held_out=(evals[0][0], evals[0][2], evals[-1][0], evals[-1][2]) if len(evals) > 1 else None,
        pass_metric=metric, held_out_pass=(passes[0][2], passes[-1][2]) if len(passes) > 1 else None,
        staleness_mean=sum(stale) / len(stale) if stale else None,
        staleness_max=max((r["staleness_max"] for r in records if "staleness_max" in r), default=None),
        refreshes=sum(a != b for a, b in zip(versions, versions[1:])),
        refresh_every=max(gaps, key=lambda gap: (gaps.count(gap), gap)) if gaps else None,
        reward_model=_head_tail(head, tail, "reward_model_mean"),
        held_out_model=(model[0][2], model[-1][2]) if len(model := eval_points(records, "reward_model")) > 1
        else None,
    )


def _head_tail(head: list[dict], tail: list[dict], key: str) -> tuple[float, float] | None:
    """The mean of ``key`` over the first and over the last steps (None when either has none)."""
    first, last = [r[key] for r in head if key in r], [r[key] for r in tail if key in r]
    return (sum(first) / len(first), sum(last) / len(last)) if first and last else None


def _refreshes(count: int, kind: str = "") -> str:
    return f"{count} {kind}refresh" + ("" if count == 1 else "es")


def _change(pair: tuple[float, float] | None) -> str:
    return "not logged" if pair is None else f"{pair[0]:.3f} -> {pair[1]:.3f}"


def locations(run_dir: str | Path, checkpoint: Path | None) -> dict[str, str | None]:
    """Where a run's outputs are: the directory, its metrics, the HF policy and the newest checkpoint (None when
    absent; ``runlog.latest_checkpoint``), and the command that draws its plots."""
    run_dir = Path(run_dir)
    return {"run_dir": str(run_dir), "metrics": str(run_dir / "metrics.jsonl"),
            "hf": str(run_dir / "hf") if (run_dir / "hf" / "config.json").exists() else None,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "report": f"offgrpo report {run_dir}"}


def format_summary(summary: RunSummary, where: dict[str, str | None]) -> str:
    """The end-of-run summary, a few lines: ``summary`` and the ``locations`` of the run."""
    lines = [f"run summary: {summary.steps} steps in {summary.wall_min:.1f} min of training loop"
             + (" (" + ", ".join(f"{part} {100 * share:.0f}%" for part, share in summary.time_share.items()) + ")"
                if summary.time_share else "")]
    lines.append(f"  sampled reward {_change(summary.reward)}, accuracy {_change(summary.accuracy)} "
                 "(first -> last fifth of the steps)")
    if summary.reward_model is not None:
        lines.append(f"  reward model's score {_change(summary.reward_model)} sampled"
                     + (f", {_change(summary.held_out_model)} held out" if summary.held_out_model else "")
                     + " (the accuracies are the rule's: the gold)")
    if summary.held_out is not None:
        s0, a0, s1, a1 = summary.held_out
        lines.append(f"  greedy held-out accuracy {a0:.3f} (step {s0}) -> {a1:.3f} (step {s1})"
                     + (f"; {summary.pass_metric} {_change(summary.held_out_pass)}" if summary.held_out_pass else ""))
    if summary.staleness_mean is not None:
        lines.append(f"  staleness {summary.staleness_mean:.2f} steps on average (max {summary.staleness_max}); "
                     f"{_refreshes(summary.refreshes, 'weight ')}"
                     + (f" (v={summary.refresh_every})" if summary.refresh_every else ""))
    run_dir = Path(where["run_dir"])
    hf, checkpoint = (None if where[key] is None else f"{Path(where[key]).relative_to(run_dir)}/"
                      for key in ("hf", "checkpoint"))
    lines.append(f"  in {run_dir}: policy (HF) {hf or 'not exported'}, checkpoint {checkpoint or 'none'}, "
                 f"{SUMMARY_FILE}, metrics.jsonl")
    lines.append(f"  plots: {where['report']}")
    return "\n".join(lines)


def write_summary(run_dir: str | Path, checkpoint: Path | None) -> tuple[RunSummary, dict[str, str | None]]:
    """Summarise the run in ``run_dir`` (whose newest checkpoint is ``checkpoint``) from its ``metrics.jsonl`` and
    write ``RUN/summary.json`` (the fields, ``time_share`` and ``locations``); returns the summary and the locations."""
    summary, where = run_summary(read_metrics(run_dir)), locations(run_dir, checkpoint)
    data = dataclasses.asdict(summary) | {"time_share": summary.time_share, "locations": where}
    path = Path(run_dir) / SUMMARY_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return summary, where


def finish_summary(run_dir: str | Path) -> str:
    """Write ``RUN/summary.json`` for the run as it ends (its newest checkpoint named) and return what the console
    prints once."""
    from megatron_offgrpo.runlog._checkpoints import latest_checkpoint

    return format_summary(*write_summary(run_dir, latest_checkpoint(run_dir)))
