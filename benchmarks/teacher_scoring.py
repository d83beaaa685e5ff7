"""Benchmark: where on-policy distillation's teacher scores the sampled tokens, on CPU, in one table.

The tiny recipe (``configs/tiny-cpu.yaml``, in-process vLLM engine) distils a teacher into a student of the same
shape (both random; the teacher's larger init makes it peaked), pure distillation (``distill.reward_weight=0``), for
``--steps`` steps, with the teacher
- ``trainer``: on the trainer's ranks (``distill.teacher_path``), a megatron forward over each step's micro-batches;
- ``fleet``: on a one-server fleet of its own (``distill.teacher_fleet``, ``offgrpo fleet start``), asked for the
  prompt log-probs of every sample once it is generated;
- ``fleet-async``: the same with ``rollout.mode=async``: the scoring runs beside the training.

Per variant, over the steps after the first: the median teacher time per step (``teacher_s``: the trainer's forward,
or rank 0's requests to the fleet), the scored response tokens per second of it, the median step time (between two
steps' records) and the trainer's time in the optimizer step (``time_train_s``). On this machine the fleet shares the
trainer's cores; on GPUs it has its own, which is the case it is for (a teacher too large for the trainer's layout).
Writes the table to ``OUT/teacher_scoring.md`` and the numbers to ``.json``.

Usage: python benchmarks/teacher_scoring.py [--steps 8] [--out runs/teacher-scoring] [--variants ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._runs import TINY, offgrpo, one_server_fleet, random_model, run_records  # noqa: E402
from benchmarks._tables import write_table  # noqa: E402
from megatron_offgrpo.config import load_config  # noqa: E402

VARIANTS = ("trainer", "fleet", "fleet-async")
COLUMNS = ["teacher", "teacher s/step", "scored tokens/s", "step s", "train s/step", "teacher_kl first -> last"]


def summarise(variant: str, records: list[dict], samples_per_step: int) -> dict:
    timed = records[1:]
    teacher = [r["teacher_s"] for r in timed]
    tokens = [r["response_len"] * samples_per_step for r in timed]
    steps = [b["wall_s"] - a["wall_s"] for a, b in zip(records, records[1:])]
    return {"teacher": variant, "teacher s/step": round(statistics.median(teacher), 3),
            "scored tokens/s": round(sum(tokens) / sum(teacher)),
            "step s": round(statistics.median(steps), 2),
            "train s/step": round(statistics.median(r["time_train_s"] for r in timed), 2),
            "teacher_kl first -> last": f"{records[0]['teacher_kl']:.3f} -> {records[-1]['teacher_kl']:.3f}"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="training steps per variant (the first is not timed)")
    parser.add_argument("--out", type=Path, default=Path("runs/teacher-scoring"), help="runs, the table, the numbers")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first is not timed)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # peaked where the student (the tiny model, random weights) is near uniform: a reverse KL well above 0
    teacher = random_model(out / "teacher", seed=5, initializer_range=0.2)
    base = ["train", "--config", "configs/tiny-cpu.yaml", "model.init=random", f"model.hf_path={TINY}",
            f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "train.loggers=[]",
            "train.overwrite=true", "distill.reward_weight=0"]
    rollout = load_config(REPO / "configs" / "tiny-cpu.yaml", []).rollout
    state = out / "teacher-fleet"  # the fleet's state dir, beside the variants' run dirs ("fleet" is one)
    rows, samples_per_step = [], rollout.prompts_per_step * rollout.group_size
    with one_server_fleet(teacher, state, wanted=any(v.startswith("fleet") for v in args.variants)):
        for variant in args.variants:
            run = out / variant
            where = [f"distill.teacher_path={teacher}"] if variant == "trainer" else [f"distill.teacher_fleet={state}"]
            mode = ["rollout.mode=async"] if variant == "fleet-async" else []
            print(f"teacher_scoring: {variant}", flush=True)
            offgrpo(*base, *where, *mode, f"train.out_dir={run}")
            rows.append(summarise(variant, run_records(run), samples_per_step))
    write_table(out, "teacher_scoring", COLUMNS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
