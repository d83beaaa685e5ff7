"""Benchmark: GRPO training steps of the real Qwen2.5-0.5B shapes (random weights) on one GPU, and the fused loss's
compiled Triton path against its torch path. One run, two markdown tables (stdout and ``--out``/gpu_step.md).

The step is the trainer's own: ``train._policy.build_policy`` (megatron GPTModel stage, DDP, megatron optimizer;
bf16 params with fp32 main weights and grads for ``--precision bf16``), ``train._batch.build_microbatches`` on
synthetic samples (random prompt and response ids, fleet log-probs near the model's, rewards 1/0 alternating, so
every group carries signal) and ``train._step.policy_step`` (megatron's forward-backward schedule with
``kernels.fused_linear_grpo_loss`` on the response tokens, then the optimizer step). ``--warmup`` steps run first,
then ``--steps`` timed steps, each between two device synchronisations; medians are reported. ``--variants``: one
row per step variant, ``eager``, ``fused`` (``model.grad_accum_fusion``: weight-gradient GEMMs accumulate into
the fp32 main grads), ``compiled`` (``model.compile``: each decoder layer ``torch.compile``d), ``graphed`` (the same
with ``model.compile_mode=reduce-overhead``: CUDA graphs of the compiled layers) and ``graphed-fused``, each with
the share of one profiled step's wall time the GPU was running a kernel ("GPU busy") and the synchronising calls
of one step (``torch.cuda.set_sync_debug_mode("warn")``).

FLOPs of one step (PaLM's MFU convention, stated so the number can be checked):
    6 * N_body * T  +  12 * L * d_q * s * T  +  6 * V * H * T_loss
N_body = per-layer matmul weights a token meets (QKV, output projection, SwiGLU; for a mixture of experts the router
and its top-k experts' SwiGLUs, not all of them) x L layers; T = positions through the model (padded micro-batches);
s = positions per sequence; d_q = query heads x head dim; the output layer only sees the T_loss response tokens
(prompts never reach it). A Qwen3-MoE config (``--config megatron_offgrpo/assets/qwen3-30b-a3b-config --layers 2``:
the real layer shapes, 2 of its 48 layers, so one GPU holds them) trains its experts with Transformer Engine's grouped
GEMM where TE is usable. MFU = FLOPs / step time / ``--peak-tflops`` (default 989: the
dense BF16 peak of an H100 SXM or H200, per NVIDIA's datasheets; FP8 steps are measured against it too).

Fused loss (default N = 16384): hidden [N, H] in the model's dtype x the model's output layer [V, H], grpo_clip, token
mean, forward + backward, on the same inputs: ``impl="torch"`` (the reference row), ``impl="triton"`` (compiled, CUDA
only), Liger's ``LigerFusedLinearGRPOLoss`` (torch.compile'd on CUDA; its row says so when liger-kernel is missing) and
the naive materialised logits. Per row: median time, peak CUDA memory above the inputs (the gradients the benchmark
keeps left out), loss difference and relative gradient difference ||g - g_torch|| / ||g_torch||.

Usage:
    python benchmarks/gpu_step.py [--precision bf16|fp8] [--fp8-recipe delayed] [--out runs/gpu-step]
    python benchmarks/gpu_step.py --config megatron_offgrpo/assets/qwen3-30b-a3b-config --layers 2 [--precision fp8]
    python benchmarks/gpu_step.py --device cpu --tiny      # tiny Qwen2, fp32, 2 steps, torch loss only (tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._gpu_loss import LOSS_COLUMNS, loss_rows, median_seconds, sync  # noqa: E402

ASSETS = REPO / "megatron_offgrpo" / "assets"
PEAK_TFLOPS = 989.0  # H100 SXM / H200 dense BF16 (NVIDIA datasheets)
VARIANTS = {"eager": dict(compile=False, grad_accum_fusion=False),
            "fused": dict(compile=False, grad_accum_fusion=True),
            "compiled": dict(compile=True, grad_accum_fusion=False),
            "graphed": dict(compile=True, compile_mode="reduce-overhead", grad_accum_fusion=False),
            "graphed-fused": dict(compile=True, compile_mode="reduce-overhead", grad_accum_fusion=True),
            "graphed-foreach-adam": dict(compile=True, compile_mode="reduce-overhead", grad_accum_fusion=False),
            "lora-r1": dict(compile=False, grad_accum_fusion=False),
            "lora-r16": dict(compile=False, grad_accum_fusion=False),
            "lora-r64": dict(compile=False, grad_accum_fusion=False)}
"""Step variant -> its ``model.`` keys. ``graphed-foreach-adam`` also puts megatron's torch AdamW back on torch's
multi-tensor path, as megatron builds it (the trainer switches it to the fused kernel: ``use_fused_adam``).
``lora-rN``: eager layers with rank-N adapters on all four linears (alpha 32), the base frozen (``lora.rank=N``)."""
FULL = dict(config=ASSETS / "qwen2.5-0.5b-config", precision="bf16", steps=5, warmup=2, seq=2048, prompt=512,
            samples=4, micro_batches=4, loss_tokens=16384, repeats=10,
            variants="eager,fused,compiled,graphed,graphed-fused")
TINY = dict(config=ASSETS / "tiny-qwen2", precision="fp32", steps=2, warmup=1, seq=32, prompt=8,
            samples=4, micro_batches=2, loss_tokens=256, repeats=2, variants="eager")
STEP_COLUMNS = ["model", "device", "precision", "layer spec", "layers", "loss impl", "tokens/step", "loss tokens/step",
                "step s (median)", "tokens/s", "TFLOP/s", "MFU", "GPU busy", "host syncs/step", "peak GiB", "loss"]



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2 and small shapes (CPU tests)")
    parser.add_argument("--config", type=Path, help="HF config directory of the shapes (default: Qwen2.5-0.5B)")
    parser.add_argument("--layers", type=int, help="decoder layers of those shapes (default: the config's)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp8"],
                        help="model.precision (default bf16; --tiny fp32)")
    parser.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "blockwise"],
                        help="model.fp8_recipe with --precision fp8 (needs Transformer Engine)")
    parser.add_argument("--fp8-amax-history", type=int, default=1024, help="model.fp8_amax_history")
    parser.add_argument("--fp8-margin", type=int, default=0, help="model.fp8_margin")
    parser.add_argument("--steps", type=int, help="timed optimizer steps (default 5; --tiny 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2; --tiny 1)")
    parser.add_argument("--seq", type=int, help="positions per sequence, prompt + response (default 2048)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per sequence (default 512)")
    parser.add_argument("--samples", type=int, help="sequences per micro-batch (default 4)")
    parser.add_argument("--micro-batches", type=int, help="micro-batches per step (default 4)")
    parser.add_argument("--group-size", type=int, default=4, help="G: samples per prompt")
    parser.add_argument("--loss-impl", default="auto", choices=["auto", "torch", "triton"],
                        help="fused-loss path inside the training step (auto: triton on CUDA)")
    parser.add_argument("--loss-tokens", type=int, help="N of the fused-loss comparison (default 16384)")
    parser.add_argument("--repeats", type=int, help="timed repeats of the fused-loss comparison (default 10)")
    parser.add_argument("--variants",
                        help="comma-separated step variants, one row each: eager, fused (model.grad_accum_fusion), "
                             "compiled (model.compile: torch.compile of each decoder layer), graphed (compiled with "
                             "compile_mode=reduce-overhead: CUDA graphs), graphed-fused, graphed-foreach-adam "
                             "(megatron's multi-tensor AdamW), lora-r1, lora-r16, lora-r64 (LoRA of that rank, the "
                             "base frozen); default the first five (--tiny: eager)")
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="per-device peak for MFU")
    parser.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile", action="store_true",
                        help="the profiled step's top-30 ops (each variant's step is profiled once for the GPU-busy "
                             "share) to OUT/profile-<variant>.txt")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-step"), help="directory for gpu_step.md/json")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.prompt < args.seq:
        parser.error(f"--prompt {args.prompt} must lie in (0, --seq {args.seq})")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers} must be >= 1")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        parser.error(f"--variants {','.join(args.variants)}: each must be one of {', '.join(VARIANTS)}")
    return args


def step_flops(arch, positions: int, seq: int, loss_tokens: int, frozen_base: bool = False) -> float:
    """FLOPs of one training step (forward + backward), by the formula in the module docstring; ``frozen_base``
    (LoRA): 4 in place of 6 per weight (no weight-gradient GEMM; the adapters' own FLOPs, r / H of the rest, left
    out)."""
    q, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    if arch.is_moe:  # the router, then the top-k experts a token is sent to
        mlp = hidden * arch.num_experts + arch.moe_top_k * 3 * hidden * arch.moe_intermediate_size
    else:
        mlp = 3 * hidden * arch.intermediate_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + mlp
    per_weight = 4 if frozen_base else 6
    body = per_weight * arch.num_layers * per_layer * positions
    attention = 12 * arch.num_layers * q * seq * positions
    head = per_weight * arch.vocab_size * hidden * loss_tokens
    return float(body + attention + head)


def synthetic_samples(arch, args) -> list:
    """B x G samples of ``args.seq + 1`` tokens (so a micro-batch has exactly ``args.seq`` positions)."""
    import torch

    from megatron_offgrpo.data import Sample

    gen = torch.Generator().manual_seed(args.seed)
    count = args.samples * args.micro_batches
    if count % args.group_size:
        raise SystemExit(f"gpu_step: --samples x --micro-batches = {count} is not a multiple of "
                         f"--group-size {args.group_size}")
    response = args.seq + 1 - args.prompt
    uniform = -math.log(arch.vocab_size)  # what a randomly initialised model assigns to any token
    samples = []
    for i in range(count):
        ids = torch.randint(0, arch.vocab_size, (args.seq + 1,), generator=gen).tolist()
        logp = (uniform + 0.05 * torch.randn(response, generator=gen)).tolist()
        samples.append(Sample(prompt_id=f"p{i // args.group_size}", group_id=i // args.group_size,
                              prompt_ids=ids[: args.prompt], response_ids=ids[args.prompt:], behavior_logprobs=logp,
                              policy_version=0, finish_reason="length", reward=float(i % 2)))
    return samples


def device_batches(samples, args, device) -> tuple[list, int, int]:
    """The trainer's micro-batches of ``samples`` on ``device``, and the step's global token / sequence counts."""
    import torch

    from megatron_offgrpo.algo import AdvantageParams, compute_group_advantages
    from megatron_offgrpo.train import build_microbatches, global_seq_count, global_token_count

    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, args.group_size, AdvantageParams())
    mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, args.group_size, 0, 1,
                             token_budget=args.samples * args.seq, device=device)
    return mbs, global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid)


def train_row(args, ctx, arch, variant: str) -> tuple[dict, object]:
    """Build the policy (``variant``: eager, or compiled layers) and time its steps: the row of the step table, and
    the trained output layer [V, H]."""
    import torch

    from megatron_offgrpo.algo import ObjectiveParams
    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.kernels import resolve_impl
    from megatron_offgrpo.model import lora, output_weight
    from megatron_offgrpo.runtime import have_te
    from megatron_offgrpo.train import build_policy, policy_step, use_fused_adam

    model_cfg = ModelConfig(hf_path=str(args.config), init="random", precision=args.precision,
                            fp8_recipe=args.fp8_recipe, fp8_amax_history=args.fp8_amax_history,
                            fp8_margin=args.fp8_margin, **VARIANTS[variant])
    adapters = lora.lora_spec(arch, int(variant[len("lora-r"):]), 32.0, 0.0, None, args.seed) if (
        variant.startswith("lora-r")) else None
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    policy = build_policy(arch, ctx, model_cfg, OptimConfig(lr=args.lr), args.warmup + args.steps,
                          adapters=adapters)
    if variant.endswith("foreach-adam"):
        for torch_adam in use_fused_adam(policy.optimizer):
            for group in torch_adam.param_groups:
                group["foreach"], group["fused"] = True, False
    mbs, tokens, seqs = device_batches(synthetic_samples(arch, args), args, ctx.device)
    params = ObjectiveParams()
    losses = []

    def step():
        result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, params, tokens, seqs, impl=args.loss_impl)
        losses.append(result.loss)
        return result

    seconds, _ = median_seconds(step, ctx.device, args.warmup, args.steps)
    timed_losses = list(losses)
    busy = _busy_fraction(step, ctx.device, args.out / f"profile-{variant}.txt" if args.profile else None)
    syncs = _count_syncs(step, ctx.device, args.out / f"profile-{variant}.txt" if args.profile else None)
    if not all(math.isfinite(loss) for loss in timed_losses):
        raise SystemExit(f"gpu_step: non-finite training loss {timed_losses}")
    on_cuda = ctx.device.type == "cuda"
    positions = sum(mb.tokens.numel() for mb in mbs)
    loss_tokens = int(sum(mb.loss_mask.sum() for mb in mbs))
    tflops = step_flops(arch, positions, mbs[0].tokens.shape[1], loss_tokens, adapters is not None) / seconds / 1e12
    # CUDA: the allocator's peak since the build (weights, grads, optimizer state, activations); CPU: this process's
    # peak RSS, which only a process of its own per variant makes comparable (benchmarks/lora.py runs them so)
    peak = (torch.cuda.max_memory_allocated() if on_cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
    spec = ("transformer-engine" + (", grouped-GEMM experts" if arch.is_moe else "")) if have_te() else "local"
    row = {"model": _model_name(args, arch), "device": _device_name(ctx.device), "precision": args.precision,
            "layer spec": spec, "layers": variant,
            "loss impl": resolve_impl(args.loss_impl, ctx.device), "tokens/step": positions,
            "loss tokens/step": loss_tokens, "step s (median)": round(seconds, 4),
            "tokens/s": round(positions / seconds, 1), "TFLOP/s": round(tflops, 2),
            "MFU": f"{100 * tflops / args.peak_tflops:.1f}%" if on_cuda else "n/a (CPU)",
            "GPU busy": f"{100 * busy:.1f}%" if busy is not None else "n/a (CPU)",
            "host syncs/step": syncs if syncs is not None else "n/a (CPU)",
            "peak GiB": round(peak, 2), "loss": f"{timed_losses[-1]:.6g}"}
    return row, output_weight(policy.model).detach()


def load_shapes(args):
    """The ``QwenArch`` of ``--config``, cut to ``--layers`` decoder layers when given."""
    from megatron_offgrpo.model import load_arch

    arch = load_arch(args.config)
    if args.layers is not None:
        if args.layers > arch.num_layers:
            raise SystemExit(f"gpu_step: --layers {args.layers}: {args.config.name} has {arch.num_layers}")
        arch = dataclasses.replace(arch, num_layers=args.layers)
    return arch


def _model_name(args, arch) -> str:
    name = args.config.name
    if args.layers is not None:
        name += f" ({arch.num_layers} layers)"
    if arch.is_moe:
        name += f", {arch.num_experts} experts top-{arch.moe_top_k}"
    return name


def _busy_fraction(step, device, path: Path | None) -> float | None:
    """One more step under torch.profiler: the fraction of its wall time the GPU ran at least one kernel (the union
    of the kernels' intervals; None on CPU). ``path``: its 30 ops with the most self device time (CPU time on CPU)
    are written there and printed."""
    import time

    from torch.profiler import ProfilerActivity, profile

    on_cuda = device.type == "cuda"
    if not on_cuda and path is None:
        return None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        sync(device)
        wall_us = (time.perf_counter() - start) * 1e6
    if path is not None:
        key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table)
        print(table)
    if not on_cuda:
        return None
    import torch

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return min(1.0, _union_length(spans) / wall_us)


def _union_length(spans: list[tuple[float, float]]) -> float:
    """Total length covered by sorted ``(start, end)`` spans (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _count_syncs(step, device, profile_path: Path | None) -> int | None:
    """Synchronising calls of one more step, as ``torch.cuda.set_sync_debug_mode("warn")`` reports them (None on
    CPU, where nothing waits: tests/train/test_step_syncs.py counts them there). With a profile file, each call's
    innermost Python frames outside torch are appended to it: the sites to remove next."""
    import collections
    import traceback
    import warnings

    import torch

    if device.type != "cuda":
        return None
    sites, torch_dir, in_step = collections.Counter(), os.path.dirname(torch.__file__), [False]

    def record(message, category, filename, lineno, file=None, line=None):
        # Called inside warnings.warn, so the stack still holds the caller: name the innermost frames outside torch.
        # Only the step's own calls count (the first set_sync_debug_mode of a process warns once itself).
        if in_step[0] and "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1]
                      if not f.filename.startswith(torch_dir) and f.filename != warnings.__file__]
            sites[" <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        in_step[0] = True
        try:
            step()
        finally:
            in_step[0] = False
            torch.cuda.set_sync_debug_mode(0)
    sync(device)
    if profile_path is not None:
        with profile_path.open("a") as f:
            f.write("\nhost synchronisations of one step, by the Python line that made them:\n")
            f.writelines(f"{count:5d}  {site}\n" for site, count in sites.most_common())
    return sum(sites.values())


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def report(args, steps: list[dict], losses: list[dict], environment: dict) -> str:
    from benchmarks._tables import markdown

    first = next(row for row in steps if row["model"])
    return "\n".join([
        f"## GPU step: {first['model']} shapes, random weights, {first['precision']}, {environment['device']}",
        f"torch {environment['torch']}, megatron-core {environment['megatron_core']}, Transformer Engine: "
        f"{environment['te']}; {args.micro_batches} micro-batches x {args.samples} sequences x {args.seq} positions "
        f"(prompt {args.prompt}); median of {args.steps} steps after {args.warmup} warm-up; "
        f"MFU against {args.peak_tflops:g} TFLOP/s; GPU busy: the share of one profiled step's wall time with a "
        "kernel running; host syncs: synchronising calls of one step (set_sync_debug_mode).", "",
        markdown(STEP_COLUMNS, steps), "",
        f"Fused loss, forward + backward, {args.loss_tokens} tokens, median of {args.repeats}:", "",
        markdown(LOSS_COLUMNS, losses), ""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: the runtime then picks gloo and CPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device here: run on a GPU machine, or --device cpu --tiny", file=sys.stderr)
        return 2
    import megatron.core
    from megatron.core import tensor_parallel

    from megatron_offgrpo.runtime import destroy_parallel, init_parallel, te_status

    ctx = init_parallel(1, 1, args.seed)
    try:
        arch = load_shapes(args)
        steps, weight = [], None
        for variant in args.variants:
            # every variant trains the same initial weights on the same data: the generators as init_parallel seeds them
            tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
            torch.manual_seed(args.seed)
            try:
                step, weight = train_row(args, ctx, arch, variant)
            except ValueError as exc:  # e.g. --precision fp8 without Transformer Engine
                print(f"gpu_step: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:  # noqa: BLE001 - one broken variant must not cost the others' GPU time
                print(f"gpu_step: {variant} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                      file=sys.stderr, flush=True)
                steps.append({**dict.fromkeys(STEP_COLUMNS, ""), "layers": variant, "step s (median)": "failed",
                              "loss": f"{type(exc).__name__} (see the log)"})
                continue
            steps.append(step)
            print(f"gpu_step: {variant}: {step['step s (median)']} s/step, MFU {step['MFU']}", flush=True)
        if weight is None:
            return 1
        losses = loss_rows(weight, args, ctx.device)
    finally:
        destroy_parallel()
    environment = {"device": _device_name(ctx.device), "torch": torch.__version__,
                   "megatron_core": megatron.core.__version__, "te": "usable" if te_status()[0] else te_status()[1]}
    text = report(args, steps, losses, environment)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step.md").write_text(text)
    (args.out / "gpu_step.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "environment": environment, "steps": steps, "loss": losses},
                                                       indent=1))
    failed = any(row["step s (median)"] == "failed" for row in steps)
    return 1 if failed or any(row["status"] == "MISMATCH" for row in losses) else 0


if __name__ == "__main__":
    sys.exit(main())
