"""Benchmark: the rollout modes (lockstep, overlap, async, async with partial rollouts) on CPU, in one table.

Lockstep, ``rollout.overlap``, ``rollout.mode=async`` and async with ``rollout.partial_rollouts``, one run each.

Two workloads (``--lengths``):
- ``demo``: one warm-up (``configs/tiny-cpu-sft.yaml``), then ``configs/tiny-cpu.yaml`` from it: short answers of
  nearly equal length (the README's demo task);
- ``long-tail``: the tiny model with random weights (it almost never stops by itself) on prompts whose completion
  caps (a data row's ``max_new_tokens``) are drawn from a log-normal (``--median-tokens``, ``--sigma``; capped at
  ``--max-tokens``): the long-tailed lengths of reasoning answers, where a batch waits for its longest response. The
  reward is constant, so ``algo.mask_zero_variance=false`` keeps every sample in the (zero) loss: the trainer still
  runs every forward and backward; only throughput is compared.

Every variant runs at the same v and the same staleness budget (lockstep: v - 1, overlap: v, async:
``rollout.max_staleness`` = v), evaluation and checkpoints off (a finished run in ``--out`` is reused). The
in-process vLLM engine serves generation in the training process, so both share the machine's cores.

Per variant, over the steps after the first (engine warm-up out): completion tokens per second of the training loop,
its ratio to lockstep, the trainer's busy share (``time_train_s`` over the loop's wall time), the generation's busy
share (``generate_s``: every batch's generation and scoring, whichever thread ran it; above 100% when several steps
generate at once), the trainer's wait for data (``time_generate_s``), the mean staleness of the trained samples and,
async only, the mean steps generating at once (``steps_in_flight``) and the seconds the engine had nothing to
generate, held by the bound (``fleet_paused_s``). Writes the table to ``OUT/async_rollout.md`` and the numbers to
``.json``.

Usage: python benchmarks/async_rollout.py [--lengths demo|long-tail] [--steps 24] [--v 4] [--out DIR] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._tables import markdown  # noqa: E402
from megatron_offgrpo.config import load_config  # noqa: E402

VARIANTS = {"lockstep": [], "overlap": ["rollout.overlap=true"], "async": ["rollout.mode=async"],
            "async+partial": ["rollout.mode=async", "rollout.partial_rollouts=true"]}
BOUNDS = {"lockstep": lambda v: v - 1, "overlap": lambda v: v, "async": lambda v: v, "async+partial": lambda v: v}
"""Each mode's staleness bound at refresh interval v (async: ``rollout.max_staleness``'s default)."""
COLUMNS = ["variant", "staleness bound", "tokens/s", "vs lockstep", "trainer busy", "generation busy",
           "trainer waits s/step", "staleness mean", "steps in flight", "paused by bound s/step"]
TINY = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"


def _offgrpo(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", *args], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarise(records: list[dict], variant: str, bound: int, samples_per_step: int) -> dict:
    """The table row of one run: the steps after the first (its wall time starts when step 0 was logged)."""
    timed = records[1:]
    wall = records[-1]["wall_s"] - records[0]["wall_s"]
    tokens = sum(r["response_len"] * samples_per_step for r in timed)
    n = len(timed)
    return {"variant": variant, "staleness bound": bound, "tokens/s": round(tokens / wall, 1),
            "trainer busy": f"{100 * sum(r['time_train_s'] for r in timed) / wall:.0f}%",
            "generation busy": f"{100 * sum(r['generate_s'] for r in timed) / wall:.0f}%",
            "trainer waits s/step": round(sum(r["time_generate_s"] for r in timed) / n, 2),
            "staleness mean": round(sum(r["staleness_mean"] for r in timed) / n, 2),
            "steps in flight": round(sum(r.get("steps_in_flight", 0.0) for r in timed) / n, 2),
            "paused by bound s/step": round(sum(r.get("fleet_paused_s", 0.0) for r in timed) / n, 2)}


def long_tail_data(path: Path, rows: int, median: float, sigma: float, most: int, seed: int) -> dict[str, float]:
    """A JSONL of ``rows`` prompts whose ``max_new_tokens`` are log-normal (median, sigma) in [1, most]; returns the
    caps' median, p90, p99 and max."""
    rng = random.Random(seed)
    caps = sorted(min(most, max(1, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(rows))
    path.write_text("".join(json.dumps({"question": f"Continue the story number {i}.", "answer": "0",
                                        "max_new_tokens": cap}) + "\n" for i, cap in enumerate(rng.sample(caps, rows))))
    return {q: caps[min(rows - 1, int(f * rows))] for q, f in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))} | {
        "max": caps[-1]}


def workload(args, out: Path) -> tuple[list[str], str]:
    """The train command's model and data arguments of ``--lengths``, and the table's title."""
    if args.lengths == "demo":
        sft = out / "sft"
        if not (sft / "hf").is_dir():
            print(f"async_rollout: warm-up into {sft}", flush=True)
            _offgrpo("sft", "--config", "configs/tiny-cpu-sft.yaml", f"train.out_dir={sft}", "train.overwrite=true")
        return [f"model.hf_path={sft / 'hf'}"], "demo task"
    data = out / "long_tail.jsonl"
    caps = long_tail_data(data, 2000, args.median_tokens, args.sigma, args.max_tokens, seed=0)
    return ([f"model.hf_path={TINY}", "model.init=random", f"data.path={data}", "data.reward=math_exact",
             f"rollout.max_new_tokens={args.max_tokens}", "algo.mask_zero_variance=false"],
            "long-tailed lengths (caps: " + ", ".join(f"{k} {v}" for k, v in caps.items()) + " tokens)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["demo", "long-tail"], default="demo",
                        help="the workload: the demo task, or long-tailed completion lengths")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--v", type=int, default=4, help="rollout.refresh_every of every run")
    parser.add_argument("--median-tokens", type=float, default=24.0, help="long-tail: the caps' median")
    parser.add_argument("--sigma", type=float, default=0.9, help="long-tail: the caps' log-normal sigma")
    parser.add_argument("--max-tokens", type=int, default=192, help="long-tail: the largest cap")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=Path("runs/async-rollout"), help="runs and the table go here")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first step is left out of the timing)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_and_data, title = workload(args, out)
    rollout = load_config(REPO / "configs" / "tiny-cpu.yaml", []).rollout
    samples_per_step = rollout.prompts_per_step * rollout.group_size
    rows = []
    for variant in args.variants:
        run = out / variant
        done = run / "metrics.jsonl"
        if done.exists() and len(_records(run)) == args.steps and (run / "summary.json").exists():
            print(f"async_rollout: {variant}: reusing the finished run in {run}", flush=True)
            rows.append(summarise(_records(run), variant, BOUNDS[variant](args.v), samples_per_step))
            continue
        print(f"async_rollout: {variant} ({args.steps} steps, v={args.v})", flush=True)
        _offgrpo("train", "--config", "configs/tiny-cpu.yaml", *model_and_data, f"train.out_dir={run}",
                 f"train.steps={args.steps}", f"rollout.refresh_every={args.v}", "train.eval_every=0",
                 "train.save_every=0", "train.overwrite=true", *VARIANTS[variant])
        rows.append(summarise(_records(run), variant, BOUNDS[variant](args.v), samples_per_step))
    base = next((r["tokens/s"] for r in rows if r["variant"] == "lockstep"), None)
    for row in rows:
        row["vs lockstep"] = f"{row['tokens/s'] / base:.2f}x" if base else "-"
    text = "\n".join([f"## Rollout modes, {title}, v = {args.v}, {args.steps} steps (step 0 left out)", "",
                      markdown(COLUMNS, rows), ""])
    print(text)
    (out / "async_rollout.md").write_text(text)
    (out / "async_rollout.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
