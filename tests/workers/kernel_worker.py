"""torchrun worker for the fused-loss TP test (gloo, CPU).

Every rank builds the same full inputs (tests/kernels/_cases.py), keeps its vocab shard of the output layer
(rank r: rows [r V/tp, (r + 1) V/tp)), runs ``fused_linear_grpo_loss`` with an explicit TP group and backward,
and saves loss, metrics, grad_hidden and its grad_weight shard to ``--out/rank{r}.pt``, plus the TP log-probs and
entropies of ``vocab_parallel_logprobs``. The Triton case runs
under the interpreter (TRITON_INTERPRET=1 is set below, before anything imports triton; this process only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # this worker is CPU-only; must precede the triton import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for tests.kernels._cases

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_offgrpo.kernels import fused_linear_grpo_loss, vocab_parallel_logprobs  # noqa: E402
from tests.kernels._cases import TP_CASES, tp_case  # noqa: E402


def run_case(name: str, group: dist.ProcessGroup, rank: int, tp: int) -> dict:
    case, chunk, impl = tp_case(name)
    hidden, weight = case.tensors()
    shard = weight.shape[0] // tp
    weight_shard = weight.detach()[rank * shard : (rank + 1) * shard].clone().requires_grad_(True)
    loss, metrics = fused_linear_grpo_loss(
        hidden, weight_shard, case.targets, case.behavior_logp, case.advantages, case.loss_mask, case.params,
        tp_group=group, chunk_size=chunk, impl=impl, **case.kwargs,
    )
    (loss * 0.5).backward()  # a non-unit upstream gradient, as the pipeline schedule gives
    return {"loss": loss.detach(), "metrics": metrics, "grad_hidden": hidden.grad, "grad_weight": weight_shard.grad}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(tp)))  # an explicit group: the kernel must not use the default one
    results = {name: run_case(name, group, rank, tp) for name in TP_CASES}
    case, _, _ = tp_case("full_torch")
    shard = case.weight.shape[0] // tp
    results["logprobs"] = vocab_parallel_logprobs(
        case.hidden, case.weight[rank * shard : (rank + 1) * shard], case.targets.clamp_min(0), temperature=0.7,
        compute_entropy=True, tp_group=group, chunk_size=5,
    )
    torch.save(results, args.out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
