"""Benchmark: RL against a learned reward model, and where its reward and the gold reward part (Gao et al. 2023,
"Scaling Laws for Reward Model Overoptimization"), on CPU, over seeds, in one table and one plot.

The warm-up policy (``offgrpo sft --config configs/tiny-cpu-sft.yaml``) is trained with off-policy GRPO against the
reward model ``offgrpo rm --config configs/tiny-cpu-rm.yaml`` fitted on its own labelled samples
(``configs/tiny-cpu-rm-rl.yaml``: ``reward.model``, ``reward.rule_weight=0``: the exact-match rule is not trained on,
only logged as the gold reward), once per seed. Per evaluation (every ``train.eval_every`` steps, 20 held-out
questions no stage trains on): the reward model's mean score of the greedy answers and their gold accuracy; per step,
the sampled answers' mean model score and gold accuracy. Where the model's score still rises and the gold falls, the
policy is over-optimising the model.
Writes the table to ``OUT/rm_overoptimisation.md``, the numbers to ``.json`` and the plot to ``--plot``.

Usage: python benchmarks/rm_overoptimisation.py [--seeds 1234 1 2] [--steps 80] [--out runs/rm-overoptimisation]
       [--plot docs/img/rm-overoptimisation.png]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._runs import offgrpo, run_records  # noqa: E402
from benchmarks._tables import write_table  # noqa: E402
from megatron_offgrpo.runlog import eval_points  # noqa: E402

RECIPE = "configs/tiny-cpu-rm-rl.yaml"
COLUMNS = ["step", "model score, held-out", "gold accuracy, held-out", "model score, sampled",
           "gold accuracy, sampled"]


def evaluations(records: list[dict]) -> dict[int, tuple[float, float]]:
    """step -> (the model's mean score, the gold accuracy) of the greedy held-out answers at each evaluation."""
    gold = {step: value for step, _, value in eval_points(records, "accuracy")}
    return {step: (value, gold[step]) for step, _, value in eval_points(records, "reward_model")}


def sampled(records: list[dict], step: int, window: int) -> tuple[float, float]:
    """The sampled answers' mean model score and gold accuracy over the ``window`` steps before ``step``."""
    rows = [r for r in records if step - window <= r["step"] + 1 <= step] or records[:1]
    return (statistics.fmean(r["reward_model_mean"] for r in rows),
            statistics.fmean(r["reward_gold_mean"] for r in rows))


def spread(values: list[float], digits: int) -> str:
    """The mean over seeds, with the range when there are several."""
    mean = f"{statistics.fmean(values):.{digits}f}"
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return mean if low == high else f"{mean} ({low} to {high})"


def table(runs: dict[int, list[dict]]) -> list[dict]:
    per_seed = {seed: evaluations(records) for seed, records in runs.items()}
    steps = sorted(set.intersection(*(set(points) for points in per_seed.values())))
    window = steps[1] - steps[0] if len(steps) > 1 else 1
    rows = []
    for step in steps:
        sampled_values = [sampled(records, step, window) for records in runs.values()]
        rows.append({"step": step,
                     "model score, held-out": spread([per_seed[s][step][0] for s in runs], 3),
                     "gold accuracy, held-out": spread([per_seed[s][step][1] for s in runs], 2),
                     "model score, sampled": spread([v[0] for v in sampled_values], 3) if step else "",
                     "gold accuracy, sampled": spread([v[1] for v in sampled_values], 2) if step else ""})
    return rows


def plot(runs: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, train) = plt.subplots(1, 2, figsize=(13, 4.5))
    held_model, train_model = held.twinx(), train.twinx()
    for k, (seed, records) in enumerate(runs.items()):
        points = sorted(evaluations(records).items())
        steps = [s for s, _ in points]
        held.plot(steps, [v[1] for _, v in points], "o-", color="C0", alpha=0.35 + 0.2 * k, label=f"gold, seed {seed}")
        held_model.plot(steps, [v[0] for _, v in points], "s--", color="C3", alpha=0.35 + 0.2 * k,
                        label=f"model, seed {seed}")
        xs = [r["step"] + 1 for r in records]
        train.plot(xs, _smooth([r["reward_gold_mean"] for r in records]), color="C0", alpha=0.35 + 0.2 * k)
        train_model.plot(xs, _smooth([r["reward_model_mean"] for r in records]), "--", color="C3",
                         alpha=0.35 + 0.2 * k)
    held.set(title="held-out questions (greedy answers)", xlabel="step", ylabel="gold accuracy (exact match)")
    held_model.set_ylabel("reward model's mean score", color="C3")
    train.set(title="sampled answers (moving average of 5 steps)", xlabel="step", ylabel="gold accuracy")
    train_model.set_ylabel("reward model's mean score", color="C3")
    held.legend(loc="upper left", fontsize=7)
    held_model.legend(loc="lower right", fontsize=7)
    fig.suptitle(f"RL against a learned reward model: {len(runs)} seeds, gold (blue) and model (red)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _smooth(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234, 1, 2], help="parallel.seed of each RL run")
    parser.add_argument("--steps", type=int, default=None, help="train.steps (default: the recipe's)")
    parser.add_argument("--out", type=Path, default=Path("runs/rm-overoptimisation"), help="runs and the table")
    parser.add_argument("--plot", type=Path, default=None, help="the PNG (default: OUT/rm_overoptimisation.png)")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = [] if args.steps is None else [f"train.steps={args.steps}"]
    runs = {}
    for seed in args.seeds:
        run = out / f"seed-{seed}"
        print(f"rm_overoptimisation: seed {seed}", flush=True)
        offgrpo("train", "--config", RECIPE, f"parallel.seed={seed}", *steps, f"train.out_dir={run}",
                "train.overwrite=true")
        runs[seed] = run_records(run)
    write_table(out, "rm_overoptimisation", COLUMNS, table(runs))
    plot(runs, args.plot or out / "rm_overoptimisation.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
