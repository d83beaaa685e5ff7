"""Benchmark: on-policy (v=1) vs off-policy (v>1) GRPO on the tiny CPU task, the demo's pipeline over several seeds.

Seed i (``parallel.seed`` = 1234 + i) is the whole demo: its own warm-up (``configs/tiny-cpu-sft.yaml``), then one
``configs/tiny-cpu.yaml`` run per v from it; only ``rollout.refresh_every`` (v) and the seed change. Reports, per v:
greedy held-out accuracy before the first update and of the trained policy, its gain (mean +- std over seeds, and the
smallest), reward over the first and the last fifth of the steps, wall-clock minutes to first reach the target reward
(moving average), generate / sync / train seconds per step, and the median run time against v=1 (run minutes: the
training loop's wall-clock, engine start-up excluded). Writes ``offgrpo report``'s panels of the seeds' mean curves.

Variants (``--variants``), each run at every v from the same warm-ups: ``grpo`` (the recipe: GRPO-clip), ``gspo``
(``algo.objective=gspo``, sequence-mean aggregation, the paper's clip range) and ``dapo`` (DAPO's dynamic sampling
with refill and its clip-higher ``algo.eps_high=0.28``), and ``grpo-async`` (the recipe in ``rollout.mode=async``,
staleness bound v: the learning side of ``benchmarks/async_rollout.py``). ``distill`` (on-policy distillation alone,
``distill.reward_weight=0``) and ``grpo-distill`` (beside the reward) take as their teacher the same seed's ``grpo``
run at the largest v (its trained policy, ``RUN/hf``), the student its warm-up: list ``grpo`` before them.
``lora-r1`` and ``lora-r16``: the recipe with LoRA adapters of that rank (alpha 32, the base frozen, adapter-only
refresh) at 10x its learning rate. The default runs the first three.

Usage: python benchmarks/onpolicy_vs_offpolicy.py [--vs 1 4] [--variants grpo gspo dapo] [--seeds 3] [--steps 40]
[--target 0.6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._runs import offgrpo, run_records  # noqa: E402

VARIANTS = {
    "grpo": [],
    "gspo": ["algo.objective=gspo", "algo.aggregation=seq_mean_token_mean"],
    "dapo": ["rollout.dynamic_sampling=true", "algo.eps_high=0.28"],
    "grpo-async": ["rollout.mode=async"],
    "distill": ["distill.teacher_path={teacher}", "distill.reward_weight=0.0"],
    "grpo-distill": ["distill.teacher_path={teacher}", "distill.reward_weight=1.0"],
    # LoRA at alpha 32: 10x the recipe's learning rate ("LoRA Without Regret": the best LoRA rate for RL is about
    # 10x full fine-tuning's, the same at every rank for a fixed alpha)
    "lora-r1": ["lora.rank=1", "optim.lr=3e-3"],
    "lora-r16": ["lora.rank=16", "optim.lr=3e-3"],
}
"""Variant -> the overrides of ``configs/tiny-cpu.yaml`` that make it ({teacher}: the seed's grpo policy)."""


def _time_to_target(records: list[dict], target: float, window: int = 5) -> float:
    rewards = [r["reward_mean"] for r in records]
    for i in range(window - 1, len(rewards)):  # a full window: one lucky first step is not a crossing
        recent = rewards[i - window + 1: i + 1]
        if sum(recent) / len(recent) >= target:
            return records[i]["wall_s"] / 60
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs", type=int, nargs="+", default=[1, 4], help="refresh intervals v to compare")
    parser.add_argument("--variants", nargs="+", default=["grpo", "gspo", "dapo"], choices=list(VARIANTS),
                        help="objectives / sampling schemes to compare at every v")
    parser.add_argument("--seeds", type=int, default=3, help="seeds (each its own warm-up) per v")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--target", type=float, default=0.6, help="reward whose first crossing is timed")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "onpolicy_vs_offpolicy", help="run directories")
    parser.add_argument("--engine", default="auto",
                        help="rollout engine of every run (auto: in-process vLLM if installed)")
    args = parser.parse_args()
    results: dict[tuple[str, int], list[dict]] = {}
    for seed in range(args.seeds):
        warmup = args.out / f"sft_seed{seed}"
        if not (warmup / "hf" / "config.json").exists():
            offgrpo("sft", "--config", "configs/tiny-cpu-sft.yaml", f"parallel.seed={1234 + seed}",
                    f"train.out_dir={warmup}")
        teacher = _run_dir(args, "grpo", max(args.vs), seed) / "hf"
        for variant in args.variants:
            overrides = [o.format(teacher=teacher) for o in VARIANTS[variant]]
            if "{teacher}" in " ".join(VARIANTS[variant]) and not (teacher / "config.json").exists():
                parser.error(f"--variants {variant}: its teacher is seed {seed}'s grpo run at v={max(args.vs)}; list "
                             "grpo before it")
            for v in args.vs:
                run_dir = _run_dir(args, variant, v, seed)
                if not (run_dir / "metrics.jsonl").exists() or len(run_records(run_dir)) < args.steps:
                    offgrpo("train", "--config", "configs/tiny-cpu.yaml", f"rollout.refresh_every={v}",
                            f"parallel.seed={1234 + seed}", f"train.steps={args.steps}", f"train.out_dir={run_dir}",
                            f"rollout.engine={args.engine}", "train.save_every=0", "train.overwrite=true",
                            f"model.hf_path={warmup / 'hf'}", *overrides)
                results.setdefault((variant, v), []).append(_summarise(run_records(run_dir), args.target))
                print(f"{variant} v={v} seed={seed}: {results[variant, v][-1]}", file=sys.stderr)
    _print_table(results, args)
    _plot(args, results)


def _run_dir(args, variant: str, v: int, seed: int) -> Path:
    return args.out / f"{variant}_v{v}_seed{seed}"


def _summarise(records: list[dict], target: float) -> dict:
    tail = records[-max(1, len(records) // 5):]
    n = len(records)
    head = records[:max(1, len(records) // 5)]
    evals = [r for r in records if "eval_accuracy" in r]
    return {"eval_before": records[0].get("eval_start_accuracy", float("nan")),
            "eval_after": evals[-1]["eval_accuracy"] if evals else float("nan"),
            "start_reward": sum(r["reward_mean"] for r in head) / len(head),
            "final_reward": sum(r["reward_mean"] for r in tail) / len(tail),
            "minutes_to_target": _time_to_target(records, target),
            "generate_s": sum(r["time_generate_s"] for r in records) / n,
            "sync_s": sum(r["time_sync_s"] for r in records) / n,
            "train_s": sum(r["time_train_s"] for r in records) / n,
            "total_min": records[-1]["wall_s"] / 60}


def _print_table(results: dict[tuple[str, int], list[dict]], args) -> None:
    def ms(values):
        values = [x for x in values if x == x]
        if not values:
            return "not reached"
        return (f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}" if len(values) > 1
                else f"{values[0]:.3f}")

    print(f"\n{args.seeds} seeds x {args.steps} steps per variant and v; target reward {args.target}\n")
    print("| variant | v | greedy held-out before | after | gain (smallest) | first-fifth reward | last-fifth reward "
          "| min to target | generate s/step | sync s/step | train s/step | run minutes | run time vs first row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(r["total_min"] for r in next(iter(results.values())))
    for (variant, v), rows in results.items():
        minutes = statistics.median(r["total_min"] for r in rows)
        gains = [r["eval_after"] - r["eval_before"] for r in rows]
        print(f"| {variant} | {v} | {ms([r['eval_before'] for r in rows])} | {ms([r['eval_after'] for r in rows])} | "
              f"{ms(gains)} ({min(gains):+.2f}) | {ms([r['start_reward'] for r in rows])} | "
              f"{ms([r['final_reward'] for r in rows])} | "
              f"{_reached([r['minutes_to_target'] for r in rows])} | "
              f"{statistics.mean(r['generate_s'] for r in rows):.2f} | "
              f"{statistics.mean(r['sync_s'] for r in rows):.3f} | {statistics.mean(r['train_s'] for r in rows):.2f} | "
              f"{minutes:.2f} | {minutes / base:.2f}x |")


def _reached(minutes: list[float]) -> str:
    """Mean minutes to the target over the seeds that reached it, and how many did."""
    hit = [m for m in minutes if m == m]
    return f"{statistics.mean(hit):.2f} ({len(hit)}/{len(minutes)} seeds)" if hit else f"not reached (0/{len(minutes)})"


def _plot(args, results) -> None:
    """``offgrpo report``'s panels with one curve per variant and v: the step-by-step mean of its seeds. Every v sees
    the same prompts at the same step (same seeds), so the per-step curves move together with prompt difficulty; the
    5-step moving average shows the trend."""
    from megatron_offgrpo.cli.report import mean_records, plot_runs

    runs = {f"{variant} v={v}": mean_records([run_records(_run_dir(args, variant, v, s)) for s in range(args.seeds)])
            for variant, v in results}
    out = plot_runs(runs, args.out / "comparison.png", window=5,
                    title=f"on- vs off-policy: {', '.join(args.variants)} (mean of {args.seeds} seeds)")
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
