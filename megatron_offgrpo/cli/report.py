"""``offgrpo report RUN_DIR [RUN_DIR ...]``: PNG plots and a summary of one run, or of several side by side.

Reward and greedy held-out accuracy (and pass@k when the run sampled its evaluations) against the step and against
wall-clock (the seed paper's comparison of refresh
intervals is the second panel with one run per v), and where the time of each step went.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_offgrpo import pyplot
from megatron_offgrpo.train import read_metrics


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def eval_points(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, wall-clock minutes, greedy accuracy) of every evaluation, the one before the first update included."""
    points = [(0, 0.0, r["eval_start_accuracy"]) for r in records[:1] if "eval_start_accuracy" in r]
    points += [(r["step"] + 1, r["wall_s"] / 60, r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    return points


def pass_points(records: list[dict]) -> tuple[str, list[tuple[int, float, float]]]:
    """(the metric, its points) of the largest pass@k the evaluations report (``train.eval_samples`` > 1), as
    ``eval_points``; ("", []) when none does."""
    keys = {key.removeprefix("eval_").removeprefix("start_") for r in records for key in r
            if key.startswith(("eval_pass@", "eval_start_pass@"))}
    if not keys:
        return "", []
    metric = max(keys, key=lambda key: int(key.split("@")[1]))
    points = [(0, 0.0, r[f"eval_start_{metric}"]) for r in records[:1] if f"eval_start_{metric}" in r]
    points += [(r["step"] + 1, r["wall_s"] / 60, r[f"eval_{metric}"]) for r in records if f"eval_{metric}" in r]
    return metric, points


def _label(run_dir: Path, records: list[dict]) -> str:
    versions = sorted({r.get("policy_version", 0) for r in records})
    gaps = [b - a for a, b in zip(versions, versions[1:])]
    return f"{run_dir.name} (v={min(gaps)})" if gaps else run_dir.name


def make_report(run_dirs: list[str | Path] | str | Path, window: int = 5, out: str | Path | None = None) -> Path:
    """Write the plots of one or more runs (default ``RUN/report.png`` of the first); returns the PNG's path."""
    plt = pyplot()  # the plot extra; without it, one line naming the extra

    dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    runs = [(d, read_metrics(d)) for d in dirs]
    for d, records in runs:
        if not records:
            raise ValueError(f"{d}/metrics.jsonl has no steps yet")
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for d, records in runs:
        label = _label(d, records) if len(runs) > 1 else "reward"
        steps, wall = [r["step"] for r in records], [r["wall_s"] / 60 for r in records]
        reward = _smooth([r.get("reward_mean", float("nan")) for r in records], window)
        line = axes[0].plot(steps, reward, label=f"{label}: sampled reward (mean of {window})")[0]
        axes[1].plot(wall, reward, color=line.get_color(), label=f"{label}: sampled reward")
        evals = eval_points(records)
        if evals:
            axes[0].plot([e[0] for e in evals], [e[2] for e in evals], "o--", color=line.get_color(),
                         label=f"{label}: greedy held-out accuracy")
            axes[1].plot([e[1] for e in evals], [e[2] for e in evals], "o--", color=line.get_color(),
                         label=f"{label}: greedy held-out accuracy")
        metric, passes = pass_points(records)
        if passes:
            for ax, x in ((axes[0], 0), (axes[1], 1)):
                ax.plot([p[x] for p in passes], [p[2] for p in passes], "s:", color=line.get_color(),
                        label=f"{label}: held-out {metric}")
    axes[0].set(xlabel="optimizer step", title="reward and accuracy vs step", ylim=(-0.02, 1.02))
    axes[1].set(xlabel="wall-clock (min)", title="reward and accuracy vs wall-clock", ylim=(-0.02, 1.02))
    _time_split(axes[2], runs[0][1])
    axes[2].set_title(f"time split per step ({runs[0][0].name})")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(", ".join(f"{d.name}: {len(r)} steps" for d, r in runs))
    fig.tight_layout()
    out = Path(out) if out is not None else dirs[0] / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _time_split(ax, records: list[dict]) -> None:
    steps, bottom = [r["step"] for r in records], [0.0] * len(records)
    for key, label in (("time_generate_s", "generate"), ("time_sync_s", "weight sync"), ("time_train_s", "train")):
        values = [r.get(key, 0.0) for r in records]
        ax.bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="optimizer step", ylabel="seconds")


def summary(run_dir: str | Path) -> str:
    """The end-of-run summary: reward change, greedy held-out accuracy before and after, where the time went."""
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    head, tail = records[: max(1, len(records) // 5)], records[-max(1, len(records) // 5):]

    def mean(rs, key):
        return sum(r.get(key, 0.0) for r in rs) / len(rs)

    total = {k: sum(r.get(k, 0.0) for r in records) for k in ("time_generate_s", "time_sync_s", "time_train_s")}
    spent = sum(total.values()) or 1.0
    evals = eval_points(records)
    held_out = (f"; greedy held-out accuracy {evals[0][2]:.3f} (step {evals[0][0]}) -> {evals[-1][2]:.3f} "
                f"(step {evals[-1][0]})" if len(evals) > 1 else "")
    metric, passes = pass_points(records)
    if len(passes) > 1:
        held_out += f", {metric} {passes[0][2]:.3f} -> {passes[-1][2]:.3f}"
    return (f"{len(records)} steps in {records[-1]['wall_s'] / 60:.1f} min: reward {mean(head, 'reward_mean'):.3f} -> "
            f"{mean(tail, 'reward_mean'):.3f} (first/last fifth), accuracy {mean(head, 'accuracy'):.3f} -> "
            f"{mean(tail, 'accuracy'):.3f}{held_out}; time: "
            + ", ".join(f"{k[5:-2]} {100 * v / spent:.0f}%" for k, v in total.items()))


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="offgrpo report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (train.out_dir); several are "
                        "drawn side by side")
    parser.add_argument("--window", type=int, default=5, help="moving-average window of the curves")
    parser.add_argument("--out", help="the PNG to write (default: report.png in the first run directory)")
    args = parser.parse_args(argv)
    try:
        for run_dir in args.run_dirs:
            print(f"{run_dir}: {summary(run_dir)}")
        print(f"plot: {make_report(args.run_dirs, args.window, args.out)}")
    except (ValueError, FileNotFoundError) as exc:  # no run there, or no step yet: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
