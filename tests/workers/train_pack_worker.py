"""torchrun worker: one step's gradient from packed micro-batches, and from shared-prompt ones (the rollout's groups
share their prompts), equals the gradient from padded ones, in the trainer's own backward pass (fused kernel,
megatron DDP), for the layout given as overrides (parallel.tp=2, ...), with each aggregation (token_mean and
seq_mean_token_mean: one set-up and rollout, the objective the only thing ``algo.aggregation`` changes)."""

from __future__ import annotations

import dataclasses
import sys

import torch

from megatron_offgrpo.algo import compute_group_advantages
from megatron_offgrpo.config import load_config
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches
from megatron_offgrpo.train._step import backward_pass, sequence_shard
from megatron_offgrpo.train._sync import share_samples
from tests.train.conftest import TINY

G = 4


def main() -> None:
    out_dir, *overrides = sys.argv[1:]
    config = load_config(None, TINY + [f"train.out_dir={out_dir}", "rollout.prompts_per_step=6", *overrides])
    trainer, rollout, log = setup(config)
    samples = share_samples(rollout.maker.generate(0).samples if rollout is not None else None)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, G, trainer.advantage)
    for s in samples:  # off-policy: behavior log-probs away from the policy's, so ratios clip
        s.behavior_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(s.behavior_logprobs)]
    assert all(len({tuple(s.prompt_ids) for s in samples[g:g + G]}) == 1 for g in range(0, len(samples), G))
    for aggregation in ("token_mean", "seq_mean_token_mean"):
        check(trainer, samples, adv, dataclasses.replace(trainer.objective, aggregation=aggregation))
    if rollout is not None:
        rollout.close()
        log.close()


def check(trainer, samples, adv, objective) -> None:
    """Padded, packed and shared-prompt micro-batches through backward_pass (which zeroes the grad buffers first)."""
    ctx, model = trainer.ctx, trainer.policy.model
    grads, counts = [], []
    for build in (build_microbatches, build_packed_microbatches, build_shared_prompt_microbatches):
        mbs = build(samples, adv.advantages, adv.sample_valid, G, ctx.dp_rank, ctx.dp_size, token_budget=96,
                    device=ctx.device, seq_multiple=sequence_shard(model, ctx)[1])
        counts.append(len(mbs))
        backward_pass(trainer.policy.ddp, ctx, mbs, objective, global_token_count(samples, adv.sample_valid),
                      global_seq_count(adv.sample_valid))
        grads.append({name: p.main_grad.clone() for name, p in model.named_parameters()})
    worst = {"packed": 0.0, "shared": 0.0}
    for layout, grad in zip(worst, grads[1:]):
        for name, padded in grads[0].items():
            err = (grad[name] - padded).abs().max().item() / max(padded.abs().max().item(), 1e-12)
            worst[layout] = max(worst[layout], err)
            assert err < 1e-5, f"{name}: {layout} vs padded relative grad error {err:.3g}"
    print(f"MATCH tp={ctx.tp_size} sp={model.config.sequence_parallel} pp={ctx.pp_size} dp={ctx.dp_size} "
          f"aggregation={objective.aggregation} micro-batches padded={counts[0]} "
          f"packed={counts[1]} shared={counts[2]} worst relative error packed {worst['packed']:.2e} "
          f"shared {worst['shared']:.2e}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
