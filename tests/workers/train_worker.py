"""torchrun worker: with v=1 and exact behavior log-probs, the GRPO-clip update equals plain on-policy GRPO
(the policy gradient -A * grad log p) bit for bit on CPU."""

from __future__ import annotations

import sys

import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._step import backward_pass, policy_step
from megatron_offgrpo.train._sync import share_samples
from tests.train.conftest import TINY


def grads(trainer, mbs, params, tokens, seqs) -> dict[str, torch.Tensor]:
    backward_pass(trainer.policy.ddp, trainer.ctx, mbs, params, tokens, seqs)
    return {n: p.main_grad.detach().clone() for n, p in trainer.policy.model.named_parameters()}


def main() -> None:
    out_dir = sys.argv[1]
    config = load_config(None, TINY + [f"train.out_dir={out_dir}", "rollout.behavior_logprobs=recompute",
                                       "rollout.refresh_every=1"])
    trainer, rollout, log = setup(config)
    samples = share_samples(rollout.maker.generate(0).samples if rollout is not None else None)
    from megatron_offgrpo.algo import compute_group_advantages

    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, 4, trainer.advantage)
    assert adv.sample_valid.any(), "need at least one group with reward variance"
    ctx = trainer.ctx
    mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, 4, ctx.dp_rank, ctx.dp_size, 4096)
    trainer.fill_logprobs(mbs)  # behavior = the snapshot pushed at v=1: the current weights, exactly
    tokens, seqs = global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid)
    clip = grads(trainer, mbs, config.algo.objective_params(), tokens, seqs)
    on_policy = grads(trainer, mbs, dataclasses_replace(config.algo, objective="gpg").objective_params(), tokens, seqs)
    nonzero = [n for n, g in clip.items() if g.abs().sum() > 0]
    assert nonzero, "no gradient at all"
    for name in clip:
        assert torch.equal(clip[name], on_policy[name]), f"{name}: GRPO-clip(v=1, exact) != on-policy GRPO"
    print(f"IDENTICAL {len(clip)} grads ({len(nonzero)} non-zero)")

    # CISPO and GSPO at v=1 with exact behavior log-probs (every ratio, token or sequence, is exactly 1): the
    # trainer's update through the fused kernel is the on-policy policy gradient under the same aggregation.
    for objective, aggregation in (("cispo", "token_mean"), ("gspo", "seq_mean_token_mean")):
        ours = grads(trainer, mbs, dataclasses_replace(config.algo, objective=objective,
                                                       aggregation=aggregation).objective_params(), tokens, seqs)
        pg = grads(trainer, mbs, dataclasses_replace(config.algo, objective="gpg",
                                                     aggregation=aggregation).objective_params(), tokens, seqs)
        for name in ours:
            assert torch.equal(ours[name], pg[name]), f"{name}: {objective}(v=1, exact) != on-policy PG"
        print(f"IDENTICAL {objective}")

    # A non-finite loss (here: a NaN behavior log-prob on a valid token) skips the step and leaves the weights.
    before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
    mbs[0].behavior_logp[mbs[0].loss_mask.nonzero()[0].tolist()[0],
                         mbs[0].loss_mask.nonzero()[0].tolist()[1]] = float("nan")
    result = policy_step(trainer.policy.ddp, trainer.policy.optimizer, ctx, mbs, config.algo.objective_params(),
                         tokens, seqs)
    assert result.skipped and result.loss != result.loss, result
    assert all(torch.equal(before[n], p) for n, p in trainer.policy.model.named_parameters()), (
        "a skipped step moved weights")
    print("SKIPPED non-finite step")
    if rollout is not None:
        rollout.close()
        log.close()


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
