"""Triton-path cases under the CPU interpreter; run by test_kernels_triton.py in a fresh process.

``TRITON_INTERPRET=1 python -m tests.kernels._triton_interp`` prints one JSON line: for each case, the loss error
(relative to the aggregated absolute per-token losses), the norm-wise gradient errors against algo's reference
loss and whether the metric keys and values agree. The variable must be set before triton is imported, which is
why this runs in its own process (it never leaks into the other tests).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_offgrpo.algo import ObjectiveParams
from megatron_offgrpo.kernels import _triton_ops, vocab_parallel_logprobs
from tests.kernels._cases import make_case, rel_err
from tests.kernels.test_kernels_fused_loss import loss_scale, run_fused, run_reference
from tests.kernels.test_kernels_masked_micro_batch import OBJECTIVES, all_masked, gspo_edges, mixed

FULL = ObjectiveParams(kl_beta=0.05, dual_clip=3.0, aggregation="seq_mean_token_mean", tis_cap=2.0,
                       tis_level="sequence")
CASES = {
    "grpo_chunk5": (dict(seed=3), 5, None),
    "full_chunk7": (dict(seed=4, params=FULL, with_fleet=True, temperature=0.7, entropy=True), 7, None),
    "multiblock_v50": (dict(seed=5, vocab=50, params=ObjectiveParams(kl_beta=0.1), entropy=True), 8, 16),
    "all_masked": (dict(seed=1, zero_variance_groups=3, entropy=True), 4, None),
}


def run_case(spec: dict, chunk: int, block_cap) -> dict:
    if block_cap is not None:  # several blocks per row (and a partial tail) at a vocabulary this small
        _triton_ops.STATS_BLOCK_CAP = _triton_ops.GRAD_BLOCK_CAP = block_cap
    try:
        case = make_case(**spec)
        ref_loss, ref_metrics, ref_gh, ref_gw = run_reference(case)
        loss, metrics, gh, gw = run_fused(case, chunk, impl="triton")
    finally:
        _triton_ops.STATS_BLOCK_CAP, _triton_ops.GRAD_BLOCK_CAP = 4096, 2048
    same = set(metrics) == set(ref_metrics) and all(
        torch.allclose(metrics[k], v, rtol=1e-5, atol=1e-6) for k, v in ref_metrics.items())
    scale = max(abs(ref_loss.item()), loss_scale(case))
    return {"loss": abs(loss.item() - ref_loss.item()) / scale if scale > 0 else abs(loss.item()),
            "grad_hidden": rel_err(gh, ref_gh), "grad_weight": rel_err(gw, ref_gw), "metrics": same}


def logprobs_case() -> dict:
    case = make_case(seed=6, vocab=50)
    targets = case.targets.clamp_min(0)
    ours = vocab_parallel_logprobs(case.hidden, case.weight, targets, temperature=0.9, compute_entropy=True,
                                   chunk_size=9, impl="triton")
    torch_path = vocab_parallel_logprobs(case.hidden, case.weight, targets, temperature=0.9, compute_entropy=True,
                                         chunk_size=9, impl="torch")
    return {"logp": rel_err(ours[0], torch_path[0]), "entropy": rel_err(ours[1], torch_path[1])}


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {name: run_case(*spec) for name, spec in CASES.items()}
    results["logprobs"] = logprobs_case()
    results["masked_objectives"] = {name: all_masked(name, "triton") for name in OBJECTIVES}
    results["mixed"] = {name: mixed(name, "triton") for name in OBJECTIVES}
    results["gspo_edges"] = gspo_edges("triton")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
