"""Measures the working memory of forward+backward in THIS (fresh) process; run by test_kernels_memory.py.

``python -m tests.kernels._memory_probe METHOD`` runs two steps and prints one JSON line with, per step, the peak
RSS during the step above the RSS at its start, minus the bytes of the returned gradients. The peak is VmHWM
after resetting it through ``/proc/self/clear_refs`` (Linux >= 4.0): exact for the step, no sampling. Run it with
``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed blocks to the OS and RSS tracks live memory (with
its default dynamic threshold, memory freed by one step is reused unseen by the next).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from megatron_offgrpo.algo import ObjectiveParams, reference_loss
from megatron_offgrpo.kernels import fused_linear_grpo_loss

N, V, H = 1024, 32768, 128
CHUNK = 128  # logits buffer: CHUNK x V x 4 B = 16 MiB


def _bytes(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _step(method: str, hidden, weight, targets, behavior, ref, adv, mask, params) -> None:
    if method == "naive":
        loss, _ = reference_loss(hidden @ weight.t(), targets, behavior, adv, mask, params, ref_logp=ref)
    else:
        loss, _ = fused_linear_grpo_loss(hidden, weight, targets, behavior, adv, mask, params, ref_logp=ref,
                                         chunk_size=CHUNK, impl="torch", compute_entropy=True)
    loss.backward()


def main(method: str) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).requires_grad_(True)
    weight = (torch.randn(V, H, generator=gen) * 0.05).requires_grad_(True)
    targets = torch.randint(0, V, (N,), generator=gen)
    behavior, ref = torch.full((N,), -10.0), torch.full((N,), -10.5)
    adv, mask = torch.randn(N, generator=gen), torch.ones(N, dtype=torch.bool)
    extra = []
    for _ in range(2):  # step 1 also pays one-time library allocations (BLAS scratch, lazy inits)
        hidden.grad = weight.grad = None
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
        start = _bytes("VmRSS")
        _step(method, hidden, weight, targets, behavior, ref, adv, mask, ObjectiveParams(kl_beta=0.04))
        extra.append(_bytes("VmHWM") - start - hidden.grad.nbytes - weight.grad.nbytes)
    print(json.dumps({"extra": extra, "logits_bytes": N * V * 4, "buffer_bytes": CHUNK * V * 4}))


if __name__ == "__main__":
    main(sys.argv[1])
