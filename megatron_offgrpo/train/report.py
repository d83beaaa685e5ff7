"""``offgrpo report RUN_DIR``: PNG plots of a run (reward and accuracy vs step and vs wall-clock, time split)."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_offgrpo.train._metrics import read_metrics


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def make_report(run_dir: str | Path, window: int = 5) -> Path:
    """Write ``RUN/report.png``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no steps yet")
    steps = [r["step"] for r in records]
    wall = [r["wall_s"] / 60 for r in records]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for key, label in (("reward_mean", "reward"), ("accuracy", "accuracy")):
        values = [r.get(key, float("nan")) for r in records]
        axes[0].plot(steps, _smooth(values, window), label=f"{label} (mean of {window})")
        axes[1].plot(wall, _smooth(values, window), label=label)
    evals = [(r["step"], r["wall_s"] / 60, r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    if evals:
        axes[0].plot([e[0] for e in evals], [e[2] for e in evals], "o-", label="eval accuracy")
        axes[1].plot([e[1] for e in evals], [e[2] for e in evals], "o-", label="eval accuracy")
    axes[0].set(xlabel="optimizer step", title="reward vs step")
    axes[1].set(xlabel="wall-clock (min)", title="reward vs wall-clock")
    bottom = [0.0] * len(records)
    for key, label in (("time_generate_s", "generate"), ("time_sync_s", "weight sync"), ("time_train_s", "train")):
        values = [r.get(key, 0.0) for r in records]
        axes[2].bar(steps, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[2].set(xlabel="optimizer step", ylabel="seconds", title="time split per step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{run_dir.name}: {len(records)} steps")
    fig.tight_layout()
    out = run_dir / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def summary(run_dir: str | Path) -> str:
    """The end-of-run summary: reward change and where the time went."""
    records = read_metrics(run_dir)
    head, tail = records[: max(1, len(records) // 5)], records[-max(1, len(records) // 5):]

    def mean(rs, key):
        return sum(r.get(key, 0.0) for r in rs) / len(rs)

    total = {k: sum(r.get(k, 0.0) for r in records) for k in ("time_generate_s", "time_sync_s", "time_train_s")}
    spent = sum(total.values()) or 1.0
    return (f"{len(records)} steps: reward {mean(head, 'reward_mean'):.3f} -> {mean(tail, 'reward_mean'):.3f} "
            f"(first/last fifth), accuracy {mean(head, 'accuracy'):.3f} -> {mean(tail, 'accuracy'):.3f}; time: "
            + ", ".join(f"{k[5:-2]} {100 * v / spent:.0f}%" for k, v in total.items()))


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="offgrpo report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run directory (train.out_dir)")
    parser.add_argument("--window", type=int, default=5, help="moving-average window of the curves")
    args = parser.parse_args(argv)
    print(summary(args.run_dir))
    print(f"plot: {make_report(args.run_dir, args.window)}")


if __name__ == "__main__":
    main()
