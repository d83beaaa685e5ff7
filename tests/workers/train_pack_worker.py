"""torchrun worker: one step's gradient from packed micro-batches equals the gradient from padded ones, in the
trainer's own backward pass (fused kernel, megatron DDP), for the layout given as overrides (parallel.tp=2, ...)."""

from __future__ import annotations

import sys

import torch

from megatron_offgrpo.algo import compute_group_advantages
from megatron_offgrpo.config import load_config
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._step import backward_pass
from megatron_offgrpo.train._sync import share_samples
from tests.train.conftest import TINY

G = 4


def main() -> None:
    out_dir, *overrides = sys.argv[1:]
    config = load_config(None, TINY + [f"train.out_dir={out_dir}", "rollout.prompts_per_step=6", *overrides])
    trainer, rollout, log = setup(config)
    samples = share_samples(rollout.generate(0).samples if rollout is not None else None)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, G, trainer.advantage)
    for s in samples:  # off-policy: behavior log-probs away from the policy's, so ratios clip
        s.behavior_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(s.behavior_logprobs)]
    ctx, model = trainer.ctx, trainer.policy.model
    grads, counts = [], []
    for build in (build_microbatches, build_packed_microbatches):
        mbs = build(samples, adv.advantages, adv.sample_valid, G, ctx.dp_rank, ctx.dp_size, token_budget=96,
                    device=ctx.device)
        counts.append(len(mbs))
        backward_pass(trainer.policy.ddp, ctx, mbs, trainer.objective, global_token_count(samples, adv.sample_valid),
                      global_seq_count(adv.sample_valid))
        grads.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
    worst = 0.0
    for name, padded in grads[0].items():
        err = (grads[1][name] - padded).abs().max().item() / max(padded.abs().max().item(), 1e-12)
        worst = max(worst, err)
        assert err < 1e-5, f"{name}: packed vs padded relative grad error {err:.3g}"
    print(f"MATCH tp={ctx.tp_size} pp={ctx.pp_size} dp={ctx.dp_size} micro-batches padded={counts[0]} "
          f"packed={counts[1]} worst relative error {worst:.2e}")
    if rollout is not None:
        rollout.close()
        log.close()


if __name__ == "__main__":
    main()
