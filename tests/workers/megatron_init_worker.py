"""torchrun worker: ``model.init=megatron`` starts the trainer's policy where ``model.init=hf`` does.

Builds the policy twice at this torchrun's TP x PP x EP: from the HF directory, and from the megatron dist checkpoint
(written at another layout); every rank compares its shards bit for bit and the trainer's probe log-probs. Prints
``MEGATRON_INIT params=<n> differing=<n> probe_diff=<max abs>`` on rank 0.
Args: HF_DIR MEGATRON_CKPT TP PP EP
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from megatron_offgrpo.config import ModelConfig, OptimConfig
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import destroy_parallel, init_parallel
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._trainer_side import probe_logprobs


def main() -> None:
    hf_dir, ckpt, tp, pp, ep = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    ctx = init_parallel(tp, pp, 1234, ep=ep)
    arch = load_arch(hf_dir)
    probe = torch.randint(0, arch.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    policies, probes = [], []
    for model_cfg in (ModelConfig(hf_path=hf_dir, init="hf"),
                      ModelConfig(hf_path=hf_dir, init="megatron", megatron_path=ckpt)):
        policy = build_policy(arch, ctx, model_cfg, OptimConfig(), steps=1)
        policies.append(dict(policy.model.named_parameters()))
        probes.append(torch.tensor(probe_logprobs(policy.model, ctx, probe), dtype=torch.float64))
    differing = torch.tensor([sum(not torch.equal(p, policies[1][name]) for name, p in policies[0].items())])
    dist.all_reduce(differing)
    count = torch.tensor([len(policies[0])])
    dist.all_reduce(count)
    if ctx.rank == 0:
        print(f"MEGATRON_INIT params={int(count)} differing={int(differing)} "
              f"probe_diff={float((probes[0] - probes[1]).abs().max()):.3e}", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
