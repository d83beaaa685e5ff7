"""Benchmark: GRPO training steps of the real Qwen2.5-0.5B shapes (random weights) on one GPU, and the fused loss's
compiled Triton path against its torch path. One run, two markdown tables (stdout and ``--out``/gpu_step.md).

The step is the trainer's own: ``train._policy.build_policy`` (megatron GPTModel stage, DDP, megatron optimizer;
bf16 params with fp32 main weights and grads for ``--precision bf16``), ``train._batch.build_microbatches`` on
synthetic samples (random prompt and response ids, fleet log-probs near the model's, rewards 1/0 alternating, so
every group carries signal) and ``train._step.policy_step`` (megatron's forward-backward schedule with
``kernels.fused_linear_grpo_loss`` on the response tokens, then the optimizer step). ``--warmup`` steps run first,
then ``--steps`` timed steps, each between two device synchronisations; medians are reported.

FLOPs of one step (PaLM's MFU convention, stated so the number can be checked):
    6 * N_body * T  +  12 * L * d_q * s * T  +  6 * V * H * T_loss
N_body = per-layer matmul weights (QKV, output projection, SwiGLU) x L layers; T = positions through the model
(padded micro-batches); s = positions per sequence; d_q = query heads x head dim; the output layer only sees the
T_loss response tokens (prompts never reach it). MFU = FLOPs / step time / ``--peak-tflops`` (default 989: the
dense BF16 peak of an H100 SXM or H200, per NVIDIA's datasheets; FP8 steps are measured against it too).

Fused loss (default N = 16384): hidden [N, H] in the model's dtype x the model's output layer [V, H], grpo_clip, token
mean, forward + backward, on the same inputs: ``impl="torch"`` (the reference row), ``impl="triton"`` (compiled, CUDA
only), Liger's ``LigerFusedLinearGRPOLoss`` (torch.compile'd on CUDA; its row says so when liger-kernel is missing) and
the naive materialised logits. Per row: median time, peak CUDA memory above the inputs (the gradients the benchmark
keeps left out), loss difference and relative gradient difference ||g - g_torch|| / ||g_torch||.

Usage:
    python benchmarks/gpu_step.py [--precision bf16|fp8] [--fp8-recipe delayed] [--out runs/gpu-step]
    python benchmarks/gpu_step.py --device cpu --tiny      # tiny Qwen2, fp32, 2 steps, torch loss only (tests)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ASSETS = REPO / "megatron_offgrpo" / "assets"
PEAK_TFLOPS = 989.0  # H100 SXM / H200 dense BF16 (NVIDIA datasheets)
# bf16 operands, fp32 accumulation: METHOD.md's expected range is 1e-3..1e-2 relative; above it is a mismatch
LOSS_MATCH_RTOL = 1e-2
FULL = dict(config=ASSETS / "qwen2.5-0.5b-config", precision="bf16", steps=5, warmup=2, seq=2048, prompt=512,
            samples=4, micro_batches=4, loss_tokens=16384, repeats=10)
TINY = dict(config=ASSETS / "tiny-qwen2", precision="fp32", steps=2, warmup=1, seq=32, prompt=8,
            samples=4, micro_batches=2, loss_tokens=256, repeats=2)
STEP_COLUMNS = ["model", "device", "precision", "layer spec", "loss impl", "tokens/step", "loss tokens/step",
                "step s (median)", "tokens/s", "TFLOP/s", "MFU", "loss"]
LOSS_COLUMNS = ["impl", "N x V", "fwd+bwd ms (median)", "peak extra MiB", "loss", "loss diff vs torch",
                "grad rel diff vs torch", "status"]
LOSS_IMPLS = ("torch", "triton", "liger", "naive")
LIGER_SEQ = 256  # tokens per sequence of the Liger row (it takes one advantage per sequence)
LIGER_CHUNK_SEQS = 8  # sequences per Liger chunk: 2048 tokens (1 sequence per chunk ran 5x slower on an H100)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny Qwen2 and small shapes (CPU tests)")
    parser.add_argument("--config", type=Path, help="HF config directory of the shapes (default: Qwen2.5-0.5B)")
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
    parser.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS, help="per-device peak for MFU")
    parser.add_argument("--lr", type=float, default=1e-6, help="Adam learning rate")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--profile", action="store_true",
                        help="one more step under torch.profiler; its top-30 ops to OUT/profile.txt")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-step"), help="directory for gpu_step.md/json")
    args = parser.parse_args(argv)
    for key, value in (TINY if args.tiny else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not 0 < args.prompt < args.seq:
        parser.error(f"--prompt {args.prompt} must lie in (0, --seq {args.seq})")
    return args


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device, warmup: int, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` between device synchronisations, after ``warmup`` calls; and its last result."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def step_flops(arch, positions: int, seq: int, loss_tokens: int) -> float:
    """FLOPs of one training step (forward + backward), by the formula in the module docstring."""
    q, kv, hidden = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.hidden_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * arch.intermediate_size
    body = 6 * arch.num_layers * per_layer * positions
    attention = 12 * arch.num_layers * q * seq * positions
    head = 6 * arch.vocab_size * hidden * loss_tokens
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
    from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count

    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, args.group_size, AdvantageParams())
    mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, args.group_size, 0, 1,
                             token_budget=args.samples * args.seq, device=device)
    return mbs, global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid)


def train_row(args, ctx, arch) -> tuple[dict, object]:
    """Build the policy and time its steps: the row of the step table, and the trained output layer [V, H]."""
    from megatron_offgrpo.algo import ObjectiveParams
    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.kernels import resolve_impl
    from megatron_offgrpo.model import output_weight
    from megatron_offgrpo.runtime import have_te
    from megatron_offgrpo.train._policy import build_policy
    from megatron_offgrpo.train._step import policy_step

    model_cfg = ModelConfig(hf_path=str(args.config), init="random", precision=args.precision,
                            fp8_recipe=args.fp8_recipe, fp8_amax_history=args.fp8_amax_history,
                            fp8_margin=args.fp8_margin)
    policy = build_policy(arch, ctx, model_cfg, OptimConfig(lr=args.lr), args.warmup + args.steps)
    mbs, tokens, seqs = device_batches(synthetic_samples(arch, args), args, ctx.device)
    params = ObjectiveParams()
    losses = []

    def step():
        result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, params, tokens, seqs, impl=args.loss_impl)
        losses.append(result.loss)
        return result

    seconds, _ = _median_seconds(step, ctx.device, args.warmup, args.steps)
    timed_losses = list(losses)
    if args.profile:
        _profile(step, ctx.device, args.out / "profile.txt")
    if not all(math.isfinite(loss) for loss in timed_losses):
        raise SystemExit(f"gpu_step: non-finite training loss {timed_losses}")
    positions = sum(mb.tokens.numel() for mb in mbs)
    loss_tokens = int(sum(mb.loss_mask.sum() for mb in mbs))
    tflops = step_flops(arch, positions, mbs[0].tokens.shape[1], loss_tokens) / seconds / 1e12
    on_cuda = ctx.device.type == "cuda"
    row = {"model": args.config.name, "device": _device_name(ctx.device), "precision": args.precision,
            "layer spec": "transformer-engine" if have_te() else "local",
            "loss impl": resolve_impl(args.loss_impl, ctx.device), "tokens/step": positions,
            "loss tokens/step": loss_tokens, "step s (median)": round(seconds, 4),
            "tokens/s": round(positions / seconds, 1), "TFLOP/s": round(tflops, 2),
            "MFU": f"{100 * tflops / args.peak_tflops:.1f}%" if on_cuda else "n/a (CPU)",
            "loss": f"{timed_losses[-1]:.6g}"}
    return row, output_weight(policy.model).detach()


def _profile(step, device, path: Path) -> None:
    """One more step under torch.profiler: the 30 ops with the most self device time (CPU time on CPU), to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table)
    print(table)


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def loss_rows(weight, args, device) -> list[dict]:
    """Fused loss forward + backward on the same random inputs: our torch path (the reference row), our compiled
    Triton path, Liger's ``LigerFusedLinearGRPOLoss`` (torch.compile'd chunks) and the naive materialised logits.

    Advantages are constant over each ``LIGER_SEQ``-token sequence (Liger takes one per sequence), so all four compute
    the same function: grpo_clip (eps 0.2), no KL, token mean."""
    import torch

    from megatron_offgrpo.algo import ObjectiveParams, reference_loss
    from megatron_offgrpo.kernels import fused_linear_grpo_loss, resolve_impl

    n, (vocab, hidden_size) = args.loss_tokens, weight.shape
    if n % LIGER_SEQ:
        raise SystemExit(f"gpu_step: --loss-tokens {n} is not a multiple of {LIGER_SEQ}")
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    hidden = torch.randn(n, hidden_size, generator=gen, device=device).to(weight.dtype)
    targets = torch.randint(0, vocab, (n,), generator=gen, device=device)
    behavior = -math.log(vocab) + 0.05 * torch.randn(n, generator=gen, device=device)
    seq_adv = torch.randn(n // LIGER_SEQ, generator=gen, device=device)
    advantages = seq_adv.repeat_interleave(LIGER_SEQ)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    params = ObjectiveParams()

    def ours(impl: str, h, w):
        loss, _ = fused_linear_grpo_loss(h, w, targets, behavior, advantages, mask, params, impl=impl)
        return loss

    def naive(h, w):
        return reference_loss((h @ w.t()).float(), targets, behavior, advantages, mask, params)[0]

    def liger_fn():
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=device.type == "cuda", use_ref_model=False,
                                           chunk_size=LIGER_CHUNK_SEQS, epsilon_low=0.2, epsilon_high=0.2,
                                           loss_type="bnpo", temperature=1.0)
        batch, seq_mask = n // LIGER_SEQ, torch.ones(n // LIGER_SEQ, LIGER_SEQ, dtype=torch.long, device=device)

        def liger(h, w):
            out = loss_fn(h.view(batch, LIGER_SEQ, hidden_size), w, targets.view(batch, LIGER_SEQ), seq_mask,
                          seq_adv, old_per_token_logps=behavior.view(batch, LIGER_SEQ))
            return out[0] if isinstance(out, tuple) else out

        return liger

    def available(name: str):
        """The loss function of ``name``, or the reason it cannot run here."""
        if name in ("torch", "triton"):
            try:
                resolve_impl(name, device)
            except ValueError:
                return "needs CUDA" if device.type != "cuda" else "triton not importable"
            return functools.partial(ours, name)
        if name == "liger":
            try:
                return liger_fn()
            except ImportError:
                return "liger-kernel not installed"
        return naive

    def forward_backward(fn):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    rows, reference = [], None
    for name in LOSS_IMPLS:
        row = dict.fromkeys(LOSS_COLUMNS, "-")
        row.update({"impl": name, "N x V": f"{n} x {vocab}"})
        fn = available(name)
        if isinstance(fn, str):
            row["status"] = fn
            rows.append(row)
            continue
        seconds, outputs = _median_seconds(functools.partial(forward_backward, fn), device, 2, args.repeats)
        # the comparison's upcasts happen once, outside the timed calls
        loss, grad_h, grad_w = outputs[0].double(), outputs[1].float(), outputs[2].float()
        del outputs
        if device.type == "cuda":
            row["peak extra MiB"] = _peak_extra_mib(functools.partial(forward_backward, fn), device)
        row.update({"fwd+bwd ms (median)": round(1e3 * seconds, 3), "loss": f"{float(loss):.6g}", "status": "ok"})
        if reference is None:
            reference = (loss, grad_h, grad_w)
        else:
            loss_diff = abs(float(loss - reference[0])) / max(abs(float(reference[0])), 1e-12)
            grad_diff = max(float((g - r).norm() / r.norm().clamp_min(1e-30))
                            for g, r in zip((grad_h, grad_w), reference[1:]))
            row.update({"loss diff vs torch": f"{loss_diff:.2e}", "grad rel diff vs torch": f"{grad_diff:.2e}",
                        "status": "ok" if max(loss_diff, grad_diff) <= LOSS_MATCH_RTOL else "MISMATCH"})
        rows.append(row)
        del grad_h, grad_w
    return rows


def _peak_extra_mib(run, device) -> int:
    """Peak CUDA memory of one ``run()`` above what was allocated before it (the gradients it makes included)."""
    import torch

    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    outputs = run()
    torch.cuda.synchronize(device)
    del outputs
    return round((torch.cuda.max_memory_allocated(device) - base) / 2**20)


def markdown(columns: list[str], rows: list[dict]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def report(args, step: dict, losses: list[dict], environment: dict) -> str:
    return "\n".join([
        f"## GPU step: {step['model']} shapes, random weights, {step['precision']}, {environment['device']}",
        f"torch {environment['torch']}, megatron-core {environment['megatron_core']}, Transformer Engine: "
        f"{environment['te']}; {args.micro_batches} micro-batches x {args.samples} sequences x {args.seq} positions "
        f"(prompt {args.prompt}); median of {args.steps} steps after {args.warmup} warm-up; "
        f"MFU against {args.peak_tflops:g} TFLOP/s.", "",
        markdown(STEP_COLUMNS, [step]), "",
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

    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel, te_status

    ctx = init_parallel(1, 1, args.seed)
    try:
        arch = load_arch(args.config)
        try:
            step, weight = train_row(args, ctx, arch)
        except ValueError as exc:  # e.g. --precision fp8 without Transformer Engine
            print(f"gpu_step: {exc}", file=sys.stderr)
            return 2
        losses = loss_rows(weight, args, ctx.device)
    finally:
        destroy_parallel()
    environment = {"device": step["device"], "torch": torch.__version__, "megatron_core": megatron.core.__version__,
                   "te": "usable" if te_status()[0] else te_status()[1]}
    text = report(args, step, losses, environment)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step.md").write_text(text)
    (args.out / "gpu_step.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "environment": environment, "step": step, "loss": losses},
                                                       indent=1))
    return 1 if any(row["status"] == "MISMATCH" for row in losses) else 0


if __name__ == "__main__":
    sys.exit(main())
