"""The fused-loss comparison of ``benchmarks/gpu_step.py`` (its second table), and the timing both tables use."""

from __future__ import annotations

import functools
import math
import statistics
import time

# bf16 operands, fp32 accumulation: METHOD.md's expected range is 1e-3..1e-2 relative; above it is a mismatch
LOSS_MATCH_RTOL = 1e-2
LOSS_COLUMNS = ["impl", "N x V", "fwd+bwd ms (median)", "peak extra MiB", "loss", "loss diff vs torch",
                "grad rel diff vs torch", "status"]
LOSS_IMPLS = ("torch", "triton", "liger", "naive")
LIGER_SEQ = 256  # tokens per sequence of the Liger row (it takes one advantage per sequence)
LIGER_CHUNK_SEQS = 8  # sequences per Liger chunk: 2048 tokens (1 sequence per chunk ran 5x slower on an H100)


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device, warmup: int, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` between device synchronisations, after ``warmup`` calls; and its last result."""
    result = None
    for _ in range(warmup):
        result = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


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
        seconds, outputs = median_seconds(functools.partial(forward_backward, fn), device, 2, args.repeats)
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
