"""Benchmark: the rollout modes (lockstep, overlap, async, async with partial rollouts) on CPU, in one table.

``rollout.mode`` lockstep, overlap, async and async_partial (the variant ``async+partial``), one run each.

Two workloads (``--lengths``):
- ``demo``: one warm-up (``configs/tiny-cpu-sft.yaml``), then ``configs/tiny-cpu.yaml`` from it: short answers of
  nearly equal length (the README's demo task);
- ``long-tail``: the tiny model with random weights (it almost never stops by itself) on prompts whose completion
  caps (a data row's ``max_new_tokens``) are drawn from a log-normal (``--median-tokens``, ``--sigma``; capped at
  ``--max-tokens``): the long-tailed lengths of reasoning answers, where a batch waits for its longest response. The
  reward is constant, so ``algo.mask_zero_variance=false`` keeps every sample in the (zero) loss: the trainer still
  runs every forward and backward; only throughput is compared.

Every variant runs at the same v and the same staleness budget (lockstep: v - 1, overlap: v, async:
``rollout.max_staleness`` = v), evaluation and checkpoints off (a finished run in ``--out`` is reused).

Two placements (``--placement``):
- ``shared``: the in-process vLLM engine serves generation in the training process; both share the machine's cores;
- ``split``: generation and training on separate cores, as a fleet on GPUs of its own: a one-server vLLM fleet
  (``offgrpo fleet start``, restarted for every variant) pinned to the last core, the trainer to the others, weights
  over the shm transport. Each side's busy share is then its cores' CPU time over the timed steps' wall time (one
  thread per core, so no spinning thread pool counts as work).

Per variant, over the steps after the first (engine warm-up out): completion tokens per second of the training loop,
its ratio to lockstep, the trainer's busy share (``time_train_s`` over the loop's wall time), the generation's busy
share (``generate_s``: every batch's generation and scoring, whichever thread ran it; above 100% when several steps
generate at once), the trainer's wait for data (``time_generate_s``), the mean staleness of the trained samples and,
async only, the mean steps generating at once (``steps_in_flight``) and the seconds the engine had nothing to
generate, held by the bound (``fleet_paused_s``). Writes the table to ``OUT/async_rollout.md`` and the numbers to
``.json``.

Usage: python benchmarks/async_rollout.py [--lengths demo|long-tail] [--placement shared|split] [--steps 24] [--v 4]
       [--fleet-max-num-seqs N] [--out DIR] [--variants ...] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._runs import TINY, offgrpo, random_model, run_records  # noqa: E402
from benchmarks._tables import markdown  # noqa: E402
from megatron_offgrpo.config import load_config  # noqa: E402

VARIANTS = {"lockstep": [], "overlap": ["rollout.mode=overlap"], "async": ["rollout.mode=async"],
            "async+partial": ["rollout.mode=async_partial"]}
BOUNDS = {"lockstep": lambda v: v - 1, "overlap": lambda v: v, "async": lambda v: v, "async+partial": lambda v: v}
"""Each mode's staleness bound at refresh interval v (async: ``rollout.max_staleness``'s default)."""
COLUMNS = ["variant", "staleness bound", "tokens/s", "vs lockstep", "trainer busy", "generation busy",
           "trainer waits s/step", "staleness mean", "steps in flight", "paused by bound s/step"]
SPLIT_COLUMNS = ["trainer core busy", "fleet core busy"]


def _pinned(cores: list[int]) -> dict:
    """Popen arguments running a process on ``cores`` alone, one thread per core."""
    return {"preexec_fn": lambda: os.sched_setaffinity(0, cores),
            "env": dict(os.environ, OMP_NUM_THREADS=str(len(cores)))}


def _cpu_seconds(pid: int, group: bool = False) -> float:
    """User + system CPU seconds so far of process ``pid`` (all its threads), or with ``group`` of every process in
    the process group it leads (a fleet server and whatever it spawned)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat") if group else [Path(f"/proc/{pid}/stat")]:
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if not group or int(fields[2]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


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


def samples_per_step(overrides: list[str]) -> int:
    """The samples a step trains: the tiny recipe's batch under the runs' ``--set`` overrides."""
    rollout = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides).rollout
    return rollout.prompts_per_step * rollout.group_size


def long_tail_data(path: Path, rows: int, median: float, sigma: float, most: int, seed: int) -> dict[str, float]:
    """A JSONL of ``rows`` prompts whose ``max_new_tokens`` are log-normal (median, sigma) in [1, most]; returns the
    caps' median, p90, p99 and max."""
    rng = random.Random(seed)
    caps = sorted(min(most, max(1, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(rows))
    path.write_text("".join(json.dumps({"question": f"Continue the story number {i}.", "answer": "0",
                                        "max_new_tokens": cap}) + "\n" for i, cap in enumerate(rng.sample(caps, rows))))
    return {q: caps[min(rows - 1, int(f * rows))] for q, f in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))} | {
        "max": caps[-1]}


def workload(args, out: Path) -> tuple[Path, list[str], str]:
    """The model directory, the train command's other model and data arguments of ``--lengths``, and the title."""
    if args.lengths == "demo":
        sft = out / "sft"
        if not (sft / "hf").is_dir():
            print(f"async_rollout: warm-up into {sft}", flush=True)
            offgrpo("sft", "--config", "configs/tiny-cpu-sft.yaml", f"train.out_dir={sft}", "train.overwrite=true")
        return sft / "hf", [], "demo task"
    data = out / "long_tail.jsonl"
    caps = long_tail_data(data, 2000, args.median_tokens, args.sigma, args.max_tokens, seed=0)
    # split: the fleet and the trainer start from one saved random model
    model, init = (TINY, ["model.init=random"]) if args.placement == "shared" else (random_model(out / "random"), [])
    return (model, [*init, f"data.path={data}", "data.reward=math_exact", f"rollout.max_new_tokens={args.max_tokens}",
                    "algo.mask_zero_variance=false"],
            "long-tailed lengths (caps: " + ", ".join(f"{k} {v}" for k, v in caps.items()) + " tokens)")


class SplitFleet:
    """A one-server fleet of ``model`` pinned to ``cores`` for one run (``offgrpo fleet start``/``stop``)."""

    def __init__(self, model: Path, state_dir: Path, cores: list[int], max_model_len: int, max_num_seqs: int):
        self.state_dir = state_dir
        subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "fleet", "start", "--model", str(model),
                        "--num-servers", "1", "--dtype", "float32", "--max-model-len", str(max_model_len),
                        "--max-num-seqs", str(max_num_seqs), "--new-token", "--state-dir", str(state_dir)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL, **_pinned(cores))
        self.pid = json.loads((state_dir / "fleet.json").read_text())["servers"][0]["pid"]

    def overrides(self, shm_dir: Path) -> list[str]:
        return ["rollout.engine=fleet", f"rollout.fleet_state={self.state_dir}", "rollout.transport=shm",
                f"rollout.shm_dir={shm_dir}", "model.init=hf"]

    def stop(self) -> None:
        subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "fleet", "stop", "--state-dir",
                        str(self.state_dir)], cwd=REPO, check=False, stdout=subprocess.DEVNULL)


def split_run(args, cmd: list[str], run: Path, model: Path, cores: list[int]) -> dict:
    """One variant with generation on a fleet pinned to the last of ``cores`` and the trainer on the others; returns
    each side's busy share: its CPU seconds over the timed steps' wall time (from step 0's record to the last's)."""
    fleet = SplitFleet(model, run.parent / f"{run.name}-fleet", cores[-1:], 64 + args.max_tokens,
                       args.fleet_max_num_seqs)
    try:
        trainer = subprocess.Popen([*cmd, *fleet.overrides(run.parent)], cwd=REPO, stdout=subprocess.DEVNULL,
                                   **_pinned(cores[:-1]))
        def reading_at(steps: int) -> tuple[float, float, float]:
            """Wall time and both sides' CPU seconds once ``steps`` steps are logged (the file polled, not /proc)."""
            log = run / "metrics.jsonl"
            while not log.exists() or len(log.read_text().splitlines()) < steps:
                if trainer.poll() is not None:
                    raise SystemExit(f"async_rollout: {run.name} ended after fewer than {steps} steps "
                                     f"({trainer.returncode})")
                time.sleep(0.05)
            return time.monotonic(), _cpu_seconds(trainer.pid), _cpu_seconds(fleet.pid, group=True)

        start, end = reading_at(1), reading_at(args.steps)  # the timed steps: after step 0 was logged
        if trainer.wait() != 0:
            raise SystemExit(f"async_rollout: {run.name} failed ({trainer.returncode})")
    finally:
        fleet.stop()
    wall = end[0] - start[0]
    return {"trainer core busy": f"{100 * (end[1] - start[1]) / (wall * len(cores[:-1])):.0f}%",
            "fleet core busy": f"{100 * (end[2] - start[2]) / wall:.0f}%"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", choices=["demo", "long-tail"], default="demo",
                        help="the workload: the demo task, or long-tailed completion lengths")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps per run")
    parser.add_argument("--v", type=int, default=4, help="rollout.refresh_every of every run")
    parser.add_argument("--median-tokens", type=float, default=24.0, help="long-tail: the caps' median")
    parser.add_argument("--sigma", type=float, default=0.9, help="long-tail: the caps' log-normal sigma")
    parser.add_argument("--max-tokens", type=int, default=192, help="long-tail: the largest cap")
    parser.add_argument("--placement", choices=["shared", "split"], default="shared",
                        help="generation in the training process on shared cores, or a fleet on a core of its own")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--fleet-max-num-seqs", type=int, default=512, metavar="N",
                        help="split: the fleet server's --max-num-seqs (sequences it decodes at once; the others "
                             "wait their turn, the oldest step's first)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every variant (repeatable), e.g. --set optim.packing=true")
    parser.add_argument("--out", type=Path, default=Path("runs/async-rollout"), help="runs and the table go here")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first step is left out of the timing)")
    cores = sorted(os.sched_getaffinity(0))
    if args.fleet_max_num_seqs < 1:
        parser.error(f"--fleet-max-num-seqs {args.fleet_max_num_seqs}: at least 1")
    if args.placement == "split" and len(cores) < 2:
        parser.error(f"--placement split needs 2 cores or more; this process may use {cores}")
    out = args.out.resolve() / args.placement
    out.mkdir(parents=True, exist_ok=True)
    model, model_and_data, title = workload(args, out)
    samples = samples_per_step(args.set)
    rows = []
    for variant in args.variants:
        run = out / variant
        done = run / "metrics.jsonl"
        if done.exists() and len(run_records(run)) == args.steps and (run / "busy.json").exists():
            print(f"async_rollout: {variant}: reusing the finished run in {run}", flush=True)
        else:
            print(f"async_rollout: {variant} ({args.steps} steps, v={args.v}, {args.placement})", flush=True)
            cmd = [sys.executable, "-m", "megatron_offgrpo.cli", "train", "--config", "configs/tiny-cpu.yaml",
                   f"model.hf_path={model}", *model_and_data, f"train.out_dir={run}", f"train.steps={args.steps}",
                   f"rollout.refresh_every={args.v}", "train.eval_every=0", "train.save_every=0",
                   "train.overwrite=true", *args.set, *VARIANTS[variant]]
            if args.placement == "split":
                busy = split_run(args, cmd, run, model, cores)
            else:
                subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
                busy = {}
            (run / "busy.json").write_text(json.dumps(busy))
        rows.append(summarise(run_records(run), variant, BOUNDS[variant](args.v), samples)
                    | json.loads((run / "busy.json").read_text()))
    base = next((r["tokens/s"] for r in rows if r["variant"] == "lockstep"), None)
    for row in rows:
        row["vs lockstep"] = f"{row['tokens/s'] / base:.2f}x" if base else "-"
    columns = COLUMNS + (SPLIT_COLUMNS if args.placement == "split" else [])
    where = ("a one-server fleet on core " + str(cores[-1]) + ", the trainer on " + str(cores[:-1])
             if args.placement == "split" else "generation in the training process, shared cores")
    text = "\n".join([f"## Rollout modes, {title}, v = {args.v}, {args.steps} steps (step 0 left out), {where}", "",
                      markdown(columns, rows), ""])
    print(text)
    (out / "async_rollout.md").write_text(text)
    (out / "async_rollout.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
