"""Worker: the policy built with model.precision=bf16 on the local spec (this CPU) takes one optimizer step.

Checks what the precision promises: bf16 model weights, fp32 main weights in megatron's optimizer (one per bf16
weight), fp32 main grads in DDP's buffers, a finite loss, and after the step bf16 weights that are exactly the
rounded fp32 main weights, which Adam moved by about the learning rate.
"""

from __future__ import annotations

import math
import sys

import torch

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
from megatron_offgrpo.config import ModelConfig, OptimConfig
from megatron_offgrpo.data import Sample
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import destroy_parallel, init_parallel
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._step import backward_pass, policy_step

G, LR = 4, 1e-3


def samples(vocab: int, prompt: int = 5, response: int = 12) -> list[Sample]:
    """Two groups of G samples: random ids, log-probs near uniform, rewards 1/0 alternating (every group valid)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(2 * G):
        ids = torch.randint(0, vocab, (prompt + response,), generator=gen).tolist()
        logp = (-math.log(vocab) + 0.3 * torch.randn(response, generator=gen)).tolist()
        out.append(Sample(f"p{i // G}", i // G, ids[:prompt], ids[prompt:], logp, 0, "length", reward=float(i % 2)))
    return out


def main() -> None:
    hf_dir = sys.argv[1]
    ctx = init_parallel(1, 1, 1234)
    arch = load_arch(hf_dir)
    policy = build_policy(arch, ctx, ModelConfig(hf_path=hf_dir, init="random", precision="bf16"),
                          OptimConfig(lr=LR, clip_grad=0.0), steps=1)
    params = dict(policy.model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}, {n: p.dtype for n, p in params.items()}
    pairs = [(model, main) for opt in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
             for models, mains in zip(opt.float16_groups, opt.fp32_from_float16_groups)
             for model, main in zip(models, mains)]
    assert len(pairs) == len(params), f"{len(pairs)} fp32 main weights for {len(params)} bf16 weights"
    assert all(main.dtype == torch.float32 and torch.equal(main.to(torch.bfloat16), model) for model, main in pairs)
    before = [main.detach().clone() for _, main in pairs]

    batch = samples(arch.vocab_size)
    adv = compute_group_advantages(torch.tensor([s.reward for s in batch]), G, AdvantageParams())
    mbs = build_microbatches(batch, adv.advantages, adv.sample_valid, G, token_budget=64)
    assert len(mbs) == 2  # 64 // 16 positions = 4 samples per micro-batch
    counts = (global_token_count(batch, adv.sample_valid), global_seq_count(adv.sample_valid))
    backward_pass(policy.ddp, ctx, mbs, ObjectiveParams(), *counts)
    assert all(p.main_grad.dtype == torch.float32 for p in params.values())
    assert sum(float(p.main_grad.abs().sum()) for p in params.values()) > 0, "no gradient reached the weights"

    result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, ObjectiveParams(), *counts)
    assert math.isfinite(result.loss) and not result.skipped, result
    moved = max(float((main - old).abs().max()) for (_, main), old in zip(pairs, before))
    assert 0.5 * LR < moved < 2 * LR, f"Adam's first step should move a weight by about lr={LR}, moved {moved:.3g}"
    assert all(torch.equal(main.to(torch.bfloat16), model) for model, main in pairs), "bf16 weights != rounded main"
    print(f"BF16 STEP loss {result.loss:.6g} grad_norm {result.grad_norm:.4g} max main-weight move {moved:.3g}")
    destroy_parallel()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
