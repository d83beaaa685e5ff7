"""Benchmark: Qwen3-MoE optimizer step and fleet-refresh export times at expert parallelism 1 vs 2 on the tiny model.

The bundled ``tiny-qwen3-moe`` (hidden 128, 2 layers, 8 experts top-2, moe_intermediate 64, the real 151,936-token
vocabulary), random-init, fp32, on the CPU (gloo), in three layouts launched with ``torch.distributed.run``:
  ep1        1 process: every expert on the one rank, the whole batch;
  dp2 ep1    2 processes, data parallel, every expert replicated on both ranks;
  dp2 ep2    2 processes, ``parallel.ep=2``: each rank holds half of every layer's experts and half of the batch;
             tokens travel to their expert's rank and back (megatron's alltoall dispatcher).
Each layout trains the same global batch (``--samples`` samples of GSM8K-like lengths, as ``benchmarks/packing.py``
makes them: one prompt per group ~ N(100, 25) tokens, log-normal responses of median ``--median``; whole groups
dealt to DP ranks as the trainer does, ``train._batch.build_microbatches``) with the trainer's own step
(``train._policy.build_policy``, ``train._step.policy_step``: megatron's schedule, the MoE router and dispatch, the
fused loss, the optimizer), and times the refresh's export (``train._weights.export_buckets``: one full iteration,
every rank iterating, the HF buckets arriving on global rank 0; with EP the experts are gathered over the EP group).
A time is the slowest rank's; reported are medians over ``--steps`` timed steps (after one warm-up step and export)
of each of ``--rounds`` launches, the layouts' launches alternating (each sees the same drift of the machine).

On this CPU machine 2 processes share 2 cores, so the ratios are not the GPU speed-up of EP (on GPUs EP=2 halves
the expert memory and compute per GPU): ``dp2 ep2 / dp2 ep1`` is the cost of EP's token dispatch and expert
gather at the same process count, and ``dp2 ep2 / ep1`` adds the two-core DP split of the batch to it.

Usage: python benchmarks/moe.py [--samples 64] [--steps 3] [--rounds 2] [--layouts ep1,dp2-ep1,dp2-ep2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
MODEL = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen3-moe"
LAYOUTS = {"ep1": (1, 1), "dp2-ep1": (2, 1), "dp2-ep2": (2, 2)}  # name -> (processes, ep)
RATIOS = (("dp2-ep2", "ep1"), ("dp2-ep2", "dp2-ep1"), ("dp2-ep1", "ep1"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _max_over_ranks(value: float) -> float:
    """The slowest rank's time (identical on every rank)."""
    import torch
    import torch.distributed as dist

    box = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def worker(args) -> None:
    """One launch of one layout (under torch.distributed.run): writes its times to ``args.result`` from rank 0."""
    import math

    import torch
    import torch.distributed as dist

    from benchmarks.packing import lengths, samples_of
    from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel, tune_cpu_memory
    from megatron_offgrpo.train import (build_microbatches, build_policy, export_buckets, global_seq_count,
                                        global_token_count, policy_step)

    tune_cpu_memory()  # as `offgrpo train` does: a step's large buffers reuse their pages
    ctx = init_parallel(1, 1, args.seed, ep=args.ep)
    try:
        arch = load_arch(args.model_dir)
        policy = build_policy(arch, ctx, ModelConfig(hf_path=str(args.model_dir), init="random"),
                              OptimConfig(lr=1e-6), args.steps + 1)
        samples = samples_of(lengths(args), arch.vocab_size, args.group_size, args.seed)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        adv = compute_group_advantages(rewards, args.group_size, AdvantageParams())
        tokens, seqs = global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid)
        mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, args.group_size, ctx.dp_rank, ctx.dp_size,
                                 args.budget, device=ctx.device)
        step_s, export_s, exported = [], [], {}
        for _ in range(args.steps + 1):  # step 0 and its export warm up
            dist.barrier()
            start = time.perf_counter()
            result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, ObjectiveParams(), tokens, seqs)
            elapsed = _max_over_ranks(time.perf_counter() - start)
            if not math.isfinite(result.loss):
                raise SystemExit(f"moe: non-finite loss at ep={args.ep}")
            step_s.append(elapsed)
            dist.barrier()
            start, count, nbytes = time.perf_counter(), 0, 0
            for bucket in export_buckets(policy.model, arch, ctx, args.bucket_mb * 1024**2):
                count += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            export_s.append(_max_over_ranks(time.perf_counter() - start))
            if ctx.rank == 0:
                exported = {"tensors": count, "MiB": round(nbytes / 1024**2, 1)}
        params = [(n, p.numel()) for n, p in policy.model.named_parameters()]
        held = torch.tensor([sum(n for name, n in params if ".experts." in name), sum(n for _, n in params)],
                            dtype=torch.float64)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        if ctx.rank == 0:
            rows = sum(mb.tokens.shape[0] for mb in mbs)
            args.result.write_text(json.dumps({
                "step_s": step_s[1:], "export_s": export_s[1:], "warmup_step_s": step_s[0],
                "warmup_export_s": export_s[0], "exported": exported, "dp": ctx.dp_size, "ep": ctx.ep_size,
                "experts_per_rank": arch.num_experts // ctx.ep_size,
                "expert_params_per_rank": int(held[0]), "params_per_rank": int(held[1]),
                "microbatches": len(mbs), "rows x positions": f"{rows} x {mbs[0].tokens.shape[1]}",
                "loss_tokens": tokens}))
    finally:
        destroy_parallel()


def _worker_argv(args, name: str, model_dir: Path, result: Path) -> list[str]:
    procs, ep = LAYOUTS[name]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", str(Path(__file__).resolve()), "--worker", "--ep", str(ep),
            "--model-dir", str(model_dir), "--result", str(result), "--samples", str(args.samples),
            "--group-size", str(args.group_size), "--median", str(args.median), "--sigma", str(args.sigma),
            "--max-response", str(args.max_response), "--budget", str(args.budget), "--steps", str(args.steps),
            "--bucket-mb", str(args.bucket_mb), "--seed", str(args.seed)]


def launch(args, name: str, model_dir: Path, result: Path) -> dict:
    """Run one layout's workers; their rank 0's JSON."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(_worker_argv(args, name, model_dir, result), cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"moe: the {name} workers failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def report(args, runs: dict[str, list[dict]]) -> dict:
    """Print the table and the ratios; the JSON result."""
    from benchmarks._tables import markdown

    rows, medians = [], {}
    for name, launches in runs.items():
        first = launches[0]
        step = statistics.median(t for run in launches for t in run["step_s"])
        export = statistics.median(t for run in launches for t in run["export_s"])
        rows.append({"layout": name, "processes": LAYOUTS[name][0], "dp": first["dp"], "ep": first["ep"],
                     "experts/rank": f"{first['experts_per_rank']} of {args.num_experts}",
                     "params/rank (M)": round(first["params_per_rank"] / 1e6, 2),
                     "expert params/rank (M)": round(first["expert_params_per_rank"] / 1e6, 3),
                     "micro-batches/rank": first["microbatches"], "rows x positions": first["rows x positions"],
                     "step s (median)": round(step, 3), "refresh export ms (median)": round(1e3 * export, 2),
                     "exported": f"{first['exported']['tensors']} tensors, {first['exported']['MiB']} MiB"})
        medians[name] = {"step": step, "refresh": export}
    ratios = {f"{a} / {b}": {what: round(medians[a][what] / medians[b][what], 3) for what in ("step", "refresh")}
              for a, b in RATIOS if a in medians and b in medians}
    first = next(iter(runs.values()))[0]
    print(f"model: tiny Qwen3-MoE random ({args.num_experts} experts top-2, vocab {args.vocab}), fp32, CPU gloo; "
          f"{args.samples} samples ({args.samples // args.group_size} prompts x {args.group_size}), "
          f"{first['loss_tokens']} loss tokens per step; {args.steps} timed steps and exports x {args.rounds} "
          f"launches of each layout (alternating)")
    print(markdown(list(rows[0]), rows))
    for pair, ratio in ratios.items():
        print(f"{pair}: step {ratio['step']:.2f}x, refresh export {ratio['refresh']:.2f}x the time")
    return {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "ratios": ratios,
            "launches": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64, help="samples per step, all DP ranks (8 prompts x 8)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=int, default=150, help="median response tokens")
    parser.add_argument("--sigma", type=float, default=0.7, help="log-normal sigma of the response length")
    parser.add_argument("--max-response", type=int, default=400, help="longest response")
    parser.add_argument("--budget", type=int, default=4096, help="optim.micro_batch_tokens")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (and exports) per launch, after a warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="launches of each layout, alternating")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--vocab", type=int, default=0,
                        help="override the vocabulary (0: the bundled config's real 151936; the output layer is then "
                             "most of a step, and a smaller one shows the MoE layers' share)")
    parser.add_argument("--bucket-mb", type=int, default=256, help="rollout.bucket_mb of the export")
    parser.add_argument("--seed", type=int, default=1234, help="lengths, tokens and initialisation seed")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one launch may take")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "moe", help="where the JSON result goes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown or not names:
        parser.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.samples % args.group_size or (args.samples // args.group_size) % 2:
        parser.error("--samples must be an even number of groups of --group-size (the DP ranks get whole groups)")
    config = json.loads((MODEL / "config.json").read_text())
    config["vocab_size"] = args.vocab = args.vocab or config["vocab_size"]
    config["max_position_embeddings"] = max(config["max_position_embeddings"], 200 + args.max_response)
    args.num_experts = config["num_experts"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        for round_ in range(args.rounds):
            for name in names:
                started = time.perf_counter()
                runs[name].append(launch(args, name, model_dir, Path(tmp) / f"{name}.{round_}.json"))
                print(f"[{name} launch {round_ + 1}/{args.rounds}: {time.perf_counter() - started:.0f} s]",
                      file=sys.stderr, flush=True)
    result = report(args, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
