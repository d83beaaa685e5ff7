"""``offgrpo report RUN_DIR [RUN_DIR ...]``: a one-line summary of each run and one PNG of panels, the runs overlaid.

Panels (3 x 3): reward +- the spread of the step's rewards; accuracy (sampled, greedy held-out, pass@k); reward and
held-out accuracy against the other x (wall-clock by default: the seed paper's comparison of refresh intervals, one
run per v); staleness and policy version; clip fractions; entropy; response length and the truncated fraction; the
trainer / fleet log-prob mismatch; where the time of each step went. A panel whose metrics a run did not log says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_offgrpo import pyplot
from megatron_offgrpo.cli._panels import PANELS, Panel, mean_records, time_split
from megatron_offgrpo.runlog import eval_points, pass_points, read_metrics, run_summary

__all__ = ["eval_points", "main", "make_report", "mean_records", "pass_points", "plot_runs", "summary"]
X_AXES = {"step": "optimizer step", "wall": "wall-clock (min)"}
_LINESTYLES = ("-", "--", "-.", ":")


def _label(run_dir: Path, records: list[dict]) -> str:
    versions = sorted({r.get("policy_version", 0) for r in records})
    gaps = [b - a for a, b in zip(versions, versions[1:])]
    return f"{run_dir.name} (v={min(gaps)})" if gaps else run_dir.name


def _records(run_dir: Path) -> list[dict]:
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    return records


def make_report(run_dirs: list[str | Path] | str | Path, window: int = 5, out: str | Path | None = None,
                x: str = "step", records: dict[Path, list[dict]] | None = None) -> Path:
    """Write the panels of one or more runs, overlaid and labelled ``name (v=N)`` (default ``report.png`` in the
    first run directory); returns the PNG's path. ``x``: "step" or "wall" (wall-clock minutes). ``records``: each
    directory's records when the caller has read them already (read once: a skipped record is warned once)."""
    dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    read = records or {d: _records(d) for d in dirs}
    runs = {(_label(d, read[d]) if len(dirs) > 1 else d.name): read[d] for d in dirs}
    if len(runs) < len(dirs):  # two directories of the same name and v: tell them apart by their path
        runs = {str(d): read[d] for d in dirs}
    title = ", ".join(f"{label}: {len(records)} steps" for label, records in runs.items())
    return plot_runs(runs, Path(out) if out is not None else dirs[0] / "report.png", window, x, title)


def plot_runs(runs: dict[str, list[dict]], out: str | Path, window: int = 5, x: str = "step",
              title: str | None = None) -> Path:
    """Draw the report's panels of ``runs`` (label -> step records; ``mean_records`` makes one of several seeds)
    into the PNG ``out``; returns its path. One run: a colour per curve; several: a colour per run."""
    if x not in X_AXES:
        raise ValueError(f"x={x!r}: pick one of {', '.join(X_AXES)}")
    if window < 1:
        raise ValueError(f"window={window}: the moving average needs at least 1 step")
    plt = pyplot()  # the plot extra; without it, one line naming the extra

    fig, axes = plt.subplots(4, 3, figsize=(19, 18))  # the panels, the time split, one slot left blank
    other = "wall" if x == "step" else "step"
    for i, (ax, panel) in enumerate(zip(axes.flat, PANELS)):
        axis = other if i == 2 else x  # the third panel: reward and held-out accuracy against the other x
        _draw_panel(ax, panel, runs, window, axis)
        ax.set_title(panel.title + (f" vs {X_AXES[axis]}" if i == 2 else ""), fontsize=10)
    _draw_time(axes.flat[len(PANELS)], runs)
    for ax in axes.flat[len(PANELS) + 1:]:
        ax.set_visible(False)
    fig.suptitle(title or ", ".join(f"{label}: {len(records)} steps" for label, records in runs.items()))
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _draw_panel(ax, panel: Panel, runs: dict[str, list[dict]], window: int, x: str) -> None:
    """The curves of every run on ``ax`` (and a twin axis for the right-hand ones); "not logged" where none."""
    twin, missing, several, names = None, [], len(runs) > 1, {}
    for r, (label, records) in enumerate(runs.items()):
        curves = panel.curves(records, window)
        if not curves:
            missing.append(label)
        for curve in curves:
            j = names.setdefault(curve.name, len(names))  # a metric keeps its line style across runs
            if curve.right and twin is None:
                twin = ax.twinx()
                twin.set_ylabel(panel.right_label)
            target = twin if curve.right else ax
            xs = curve.step if x == "step" else curve.wall
            style = _LINESTYLES[j % len(_LINESTYLES)] if several and curve.style == "-" else curve.style
            color = f"C{r if several else j}"
            target.plot(xs, curve.y, style, color=color, markersize=4, label=f"{label}: {curve.name}" if several
                        else curve.name + (" (right axis)" if curve.right else ""))
            if curve.band is not None:
                target.fill_between(xs, *curve.band, color=color, alpha=0.15, linewidth=0)
    if len(missing) == len(runs):
        ax.text(0.5, 0.5, f"not logged\n({panel.reads})", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    elif missing:
        ax.text(0.01, 0.01, "not logged by " + ", ".join(missing), transform=ax.transAxes, color="gray", fontsize=8)
    ax.set(xlabel=X_AXES[x], ylabel=panel.ylabel)
    if panel.ylim is not None:
        ax.set_ylim(*panel.ylim)
    ax.grid(alpha=0.3)
    handles = [h for a in (ax, twin) if a is not None for h in a.get_legend_handles_labels()[0]]
    if handles:
        ax.legend(handles=handles, fontsize=7)


def _draw_time(ax, runs: dict[str, list[dict]]) -> None:
    """One run: generate / weight sync / train seconds stacked per step. Several: one stacked bar per run, its mean
    seconds per step."""
    if len(runs) == 1:
        [records] = runs.values()
        xs, parts = [r["step"] for r in records], time_split(records)
        ax.set(xlabel=X_AXES["step"], ylabel="seconds", title="time split per step")
    else:
        splits = [time_split(records) for records in runs.values()]
        xs = list(range(len(runs)))
        parts = {part: [sum(s[part]) / max(len(s[part]), 1) for s in splits] for part in splits[0]}
        ax.set_xticks(xs, list(runs), rotation=15, fontsize=8)
        ax.set(ylabel="seconds per step (mean)", title="time split per step, mean of each run")
    bottom = [0.0] * len(xs)
    for part, values in parts.items():
        ax.bar(xs, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    if not any(bottom):
        ax.text(0.5, 0.5, "not logged\n(time_generate_s, time_sync_s, time_train_s)", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def summary(run_dir: str | Path) -> str:
    """A run in one line: reward and sampled accuracy change, greedy held-out accuracy before and after (pass@k),
    where the time went, staleness and refreshes (``megatron_offgrpo.runlog._summary.RunSummary.line``)."""
    return run_summary(_records(Path(run_dir))).line()


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="offgrpo report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (train.out_dir); several are "
                        "overlaid in every panel")
    parser.add_argument("--window", type=int, default=5, help="moving-average window of the per-step curves")
    parser.add_argument("--x", choices=list(X_AXES), default="step", help="x axis of the panels: optimizer step or "
                        "wall-clock minutes (the reward / held-out accuracy panel shows the other one)")
    parser.add_argument("--out", help="the PNG to write (default: report.png in the first run directory)")
    args = parser.parse_args(argv)
    try:
        records = {Path(d): _records(Path(d)) for d in args.run_dirs}
        for run_dir in args.run_dirs:
            print(f"{run_dir}: {run_summary(records[Path(run_dir)]).line()}")
        print(f"plot: {make_report(args.run_dirs, args.window, args.out, args.x, records)}")
    except (ValueError, FileNotFoundError) as exc:  # no run there, or no step yet: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
