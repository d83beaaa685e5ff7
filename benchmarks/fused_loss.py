"""Fused GRPO loss vs naive (materialised logits) vs Liger vs the GEMM floor, at Qwen2.5-0.5B shapes, on CPU.

One run prints one markdown table. Every forward+backward runs in its own fresh process (clean allocator and RSS),
in ``--repeats`` rounds that each run every method once in turn (so the noise of a shared machine hits all methods
alike), on the same inputs: hidden [N, H] and output layer [V, H] in float32 (V = 151,936, H = 896), all N tokens
valid, grpo_clip (eps 0.2) + k3 KL (beta 0.04) against reference log-probs, token-mean aggregation.

- naive: ``logits = hidden @ W^T`` then ``algo.reference_loss`` and autograd.
- liger: ``LigerFusedLinearGRPOLoss`` (liger-kernel, eager; loss_type="bnpo" = token mean, k3 KL) over
  [N / 256, 256] sequences, chunk_size=1 (256 tokens per chunk); its row says so when liger is not installed.
- ours: ``megatron_offgrpo.kernels.fused_linear_grpo_loss`` (impl="torch", default chunk size).
- ours_gspo: the same with ``objective="gspo"`` (sequence ratio over [N / 256, 256] sequences, seq-mean-token-mean):
  its first pass over the log-probs is the price of a sequence-level ratio.
- floor: the three GEMMs (logits, grad_h, grad_W) with torch.matmul, in blocks of at most 2048 tokens.

Columns: working memory = peak RSS during one forward+backward above the RSS at its start, minus the bytes of the
gradients it returns (grad_W alone is V H 4 = 545 MB), max over the rounds; median time of forward+backward.
Peak RSS is read as VmHWM after resetting it (``/proc/self/clear_refs``), so short peaks are not missed; workers run
with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed memory leaves RSS. Naive is not run where its estimated memory exceeds
3/4 of MemAvailable (its row says so).

Usage: ``python benchmarks/fused_loss.py [--tokens 2048 8192] [--repeats 3] [--threads 2]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VOCAB, HIDDEN, SEQ = 151_936, 896, 256
METHODS = ("floor", "naive", "liger", "ours", "ours_gspo")
NAIVE_BYTES_PER_LOGIT = 10.5  # measured 10.3 B per logit at N=2048 (3.2 GB): logits, log-softmax, their grads
NAIVE_MEMORY_SHARE = 0.75  # run naive only if it needs at most this share of MemAvailable (the machine is shared)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> int:
    """Resets the peak-RSS mark and returns the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS") * 1024


def _inputs(n: int):
    import math

    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, HIDDEN, generator=gen)
    weight = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02  # logits ~ N(0, 0.6^2): logp ~ -log V
    targets = torch.randint(0, VOCAB, (n,), generator=gen)
    behavior = -math.log(VOCAB) + 0.2 * torch.randn(n, generator=gen)  # ratios exp(+-0.2..): some tokens clip
    ref = -math.log(VOCAB) + 0.2 * torch.randn(n, generator=gen)
    adv = torch.randn(n // SEQ, generator=gen).repeat_interleave(SEQ)
    return hidden, weight, targets, behavior, adv, ref


def _step_fn(method: str, n: int):
    """Returns ``step() -> tuple of gradient tensors`` for one forward+backward of ``method``."""
    import torch

    from megatron_offgrpo.algo import ObjectiveParams, reference_loss
    from megatron_offgrpo.kernels import fused_linear_grpo_loss

    hidden, weight, targets, behavior, adv, ref = _inputs(n)
    mask = torch.ones(n, dtype=torch.bool)
    params = ObjectiveParams(kl_beta=0.04)
    h = hidden.requires_grad_(method != "floor")
    w = weight.requires_grad_(method != "floor")

    def naive():
        loss, _ = reference_loss(h @ w.t(), targets, behavior, adv, mask, params, ref_logp=ref)
        loss.backward()
        return h.grad, w.grad

    def ours():
        loss, _ = fused_linear_grpo_loss(h, w, targets, behavior, adv, mask, params, ref_logp=ref, impl="torch")
        loss.backward()
        return h.grad, w.grad

    def ours_gspo():
        gspo = ObjectiveParams(objective="gspo", aggregation="seq_mean_token_mean", kl_beta=0.04)
        loss, _ = fused_linear_grpo_loss(h, w, targets, behavior, adv, mask, gspo, ref_logp=ref,
                                         seq_ids=torch.arange(n) // SEQ, impl="torch")
        loss.backward()
        return h.grad, w.grad

    def floor():
        block = min(n, 2048)
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(w)
        for start in range(0, n, block):
            logits = torch.matmul(h[start : start + block], w.t())
            grad_h[start : start + block] = torch.matmul(logits, w)
            grad_w.addmm_(logits.t(), h[start : start + block])
            del logits
        return grad_h, grad_w

    steps = {"naive": naive, "ours": ours, "ours_gspo": ours_gspo, "floor": floor}
    if method == "liger":
        steps["liger"] = _liger_step(h, w, targets, behavior, adv, ref, n)
    return steps[method], (h, w)


def _liger_step(h, w, targets, behavior, adv, ref, n: int):
    import torch
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    batch = n // SEQ
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.04, compiled=False, use_ref_model=True, chunk_size=1, epsilon_low=0.2, epsilon_high=0.2,
        loss_type="bnpo", temperature=1.0,
    )
    x3 = h.view(batch, SEQ, HIDDEN)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    seq_adv = adv.view(batch, SEQ)[:, 0].contiguous()

    def step():
        out = loss_fn(x3, w, targets.view(batch, SEQ), mask, seq_adv, ref_per_token_logps=ref.view(batch, SEQ),
                      old_per_token_logps=behavior.view(batch, SEQ))
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        return h.grad, w.grad

    return step


def worker(method: str, n: int) -> dict:
    """One forward+backward of one method in this (fresh) process: its time and working memory."""
    import torch

    if method == "liger":
        try:
            import liger_kernel  # noqa: F401
        except ImportError:
            return {"status": "not installed (pip install liger-kernel==0.8.5 --no-deps)"}
    step, _ = _step_fn(method, n)
    gc.collect()
    start_rss = _reset_peak()
    t0 = time.perf_counter()
    grads = step()
    elapsed = time.perf_counter() - t0
    extra = _status_kb("VmHWM") * 1024 - start_rss - sum(g.numel() * g.element_size() for g in grads)
    return {"status": "ok", "time": elapsed, "extra": extra, "threads": torch.get_num_threads()}


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_once(method: str, n: int, threads: int) -> dict:
    """Runs ``worker`` in a fresh process; skips naive when its logits would crowd the machine's free memory."""
    if method == "naive":
        need, free = NAIVE_BYTES_PER_LOGIT * n * VOCAB, _mem_available()
        if need > NAIVE_MEMORY_SHARE * free:
            return {"status": f"not run: needs ~{need / 1e9:.1f} GB, more than {NAIVE_MEMORY_SHARE:.0%} of the "
                              f"{free / 1e9:.1f} GB available"}
    # a fixed mmap threshold makes glibc return freed blocks >= 64 KiB to the OS, so RSS tracks live memory
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="65536")
    cmd = [sys.executable, __file__, "--worker", method, "--tokens", str(n)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"status": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_rounds(methods: list[str], n: int, repeats: int, threads: int) -> dict[str, dict]:
    """``repeats`` rounds, each running every method once in turn, so machine noise hits all methods alike."""
    results: dict[str, dict] = {m: {"status": "ok", "times": [], "extra": []} for m in methods}
    for _ in range(repeats):
        for method in methods:
            if results[method]["status"] != "ok":
                continue
            one = run_once(method, n, threads)
            if one["status"] != "ok":
                results[method] = one
                continue
            results[method]["times"].append(one["time"])
            results[method]["extra"].append(one["extra"])
    return results


def _row(n: int, method: str, res: dict, naive: dict, floor: dict) -> str:
    if res.get("status") != "ok":
        return f"| {n} | {method} | - | - | - | - | - | - | - | {res.get('status')} |"
    med, best, mem = statistics.median(res["times"]), min(res["times"]), max(res["extra"])

    def ratio(value: float, other: dict, pick, digits: int = 2) -> str:
        return "-" if other.get("status") != "ok" else f"{value / pick(other):.{digits}f}x"

    def time_ratios(other: dict) -> str:
        by_median = ratio(med, other, lambda r: statistics.median(r["times"]))
        return f"{by_median} / {ratio(best, other, lambda r: min(r['times']))}"

    mem_naive = ratio(mem, naive, lambda r: max(r["extra"]), 3)
    runs = ", ".join(f"{x:.1f}" for x in res["times"])
    cells = [n, method, f"{mem / 1e6:,.0f}", mem_naive, f"{med:.2f}", f"{best:.2f}", time_ratios(naive),
             time_ratios(floor), runs]
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens[0])))
        return
    print(f"V={VOCAB}, H={HIDDEN}, float32, CPU, {args.threads} threads; {args.repeats} rounds, each running every "
          "method once in a fresh process; working memory = max over rounds; time = forward+backward, median and "
          "best over rounds (on a shared machine the best is the least disturbed)\n")
    print("| N | method | working memory (MB) | mem vs naive | median (s) | best (s) | time vs naive (median / best) "
          "| vs floor (median / best) | runs (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.tokens:
        results = run_rounds(args.methods, n, args.repeats, args.threads)
        for method in args.methods:
            print(_row(n, method, results[method], results.get("naive", {}), results.get("floor", {})), flush=True)


if __name__ == "__main__":
    main()
