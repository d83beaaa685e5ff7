"""Benchmark: LoRA against full fine-tuning: the trainer's step time and peak memory. One run, one table.

Each variant (``full``, then ``lora-r1``, ``lora-r16``, ``lora-r64``: adapters on all four linears, alpha 32, the base
frozen) runs ``benchmarks/gpu_step.py`` in a process of its own (the trainer's own ``build_policy`` and
``policy_step``: megatron GPTModel, DDP, optimizer, the fused loss) on the same synthetic batch, so each process's peak
is its own: on CPU the process's peak RSS (``getrusage``), on CUDA the allocator's peak. Ratios are against the full
fine-tuning row of the same run. Goals (issue 49, the Qwen2.5-0.5B shape): peak memory <= 0.7x and step time <= 0.8x
full fine-tuning's at r = 16.

Why LoRA is cheaper: the frozen base has no weight gradients (every weight-gradient GEMM, the output layer's
included, is skipped: 4 of the 6 FLOPs per weight and token remain), no fp32 gradient buffer and no Adam moments.

Usage: python benchmarks/lora.py [--config DIR] [--variants full,lora-r1,lora-r16,lora-r64] [--device cpu|cuda]
                                 [--seq 128] [--samples 2] [--micro-batches 1] [--steps 3] [--out runs/lora]
       python benchmarks/lora.py --tiny       # the tiny Qwen2, seconds (tests)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._tables import markdown  # noqa: E402

QWEN05 = REPO / "megatron_offgrpo" / "assets" / "qwen2.5-0.5b-config"
COLUMNS = ["variant", "trained parameters", "step s (median)", "step vs full", "peak GiB", "peak vs full", "loss"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=QWEN05, help="HF config directory (default Qwen2.5-0.5B)")
    parser.add_argument("--variants", default="full,lora-r1,lora-r16,lora-r64", help="comma-separated")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", default=None, help="model.precision (default fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--seq", type=int, default=128, help="positions per sequence")
    parser.add_argument("--samples", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Qwen2 (tests)")
    parser.add_argument("--out", type=Path, default=Path("runs/lora"))
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.precision is None:
        args.precision = "fp32" if args.device == "cpu" else "bf16"
    return args


def run_variant(args, variant: str, workdir: Path) -> dict:
    """One variant in its own process: gpu_step's row (its peak: that process's alone)."""
    out = workdir / variant
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--device", args.device,
               "--variants", "eager" if variant == "full" else variant, "--out", str(out), "--loss-tokens", "256",
               "--repeats", "1", "--warmup", "1", "--steps", str(args.steps)]
    if args.tiny:
        command += ["--tiny"]
    else:
        command += ["--config", str(args.config), "--precision", args.precision, "--seq", str(args.seq),
                    "--prompt", str(args.seq // 4), "--samples", str(args.samples),
                    "--micro-batches", str(args.micro_batches)]
    proc = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lora benchmark: {variant} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    row = json.loads((out / "gpu_step.json").read_text())["steps"][0]
    return {"variant": variant, "step s (median)": float(row["step s (median)"]), "peak GiB": float(row["peak GiB"]),
            "loss": row["loss"]}


def trained_parameters(args, variant: str) -> int:
    """Parameters the optimizer holds: every weight, or the adapters' (r x (in + out) per adapted linear)."""
    from megatron_offgrpo.model import load_arch

    arch = load_arch(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2" if args.tiny else args.config)
    hidden, q, kv, ffn = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.intermediate_size
    if variant == "full":
        per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * ffn + 2 * hidden
        embeddings = arch.vocab_size * hidden * (1 if arch.tie_word_embeddings else 2)
        return arch.num_layers * per_layer + embeddings + hidden
    rank = int(variant[len("lora-r"):])
    # (in, out) of linear_qkv, linear_proj, linear_fc1 (gate and up), linear_fc2
    shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * ffn), (ffn, hidden)]
    return arch.num_layers * sum(rank * (i + o) for i, o in shapes)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        rows = []
        for variant in args.variants:
            row = run_variant(args, variant, Path(tmp))
            row["trained parameters"] = f"{trained_parameters(args, variant):,}"
            rows.append(row)
            print(f"lora benchmark: {variant}: {row['step s (median)']} s/step, peak {row['peak GiB']} GiB", flush=True)
    full = next((r for r in rows if r["variant"] == "full"), None)
    for row in rows:
        row["step vs full"] = f"{row['step s (median)'] / full['step s (median)']:.2f}x" if full else "n/a"
        row["peak vs full"] = f"{row['peak GiB'] / full['peak GiB']:.2f}x" if full else "n/a"
    name = "tiny-qwen2" if args.tiny else args.config.name
    text = "\n".join([f"## LoRA vs full fine-tuning: {name} shapes, random weights, {args.precision}, {args.device}",
                      f"{args.micro_batches} micro-batch(es) x {args.samples} sequences x {args.seq} positions; "
                      f"median of {args.steps} steps after 1 warm-up; peak: "
                      + ("the process's peak RSS" if args.device == "cpu" else "CUDA allocator peak"), "",
                      markdown(COLUMNS, rows), ""])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora.md").write_text(text)
    (args.out / "lora.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
