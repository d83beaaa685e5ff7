"""torchrun worker: the trainer's gradient (micro-batches x DP ranks, fused kernel, megatron DDP) equals the
gradient of ``algo.reference_loss`` over the whole step on materialised logits (one process, plain autograd), with
padded micro-batches or packed ones (argv[3]: "padded", "packed" (several sequences per row, block-diagonal causal
mask) or both, comma-separated), for each aggregation of argv[2] (comma-separated): one set-up and rollout, then
each layout with each aggregation (the micro-batches' layout and the objective's aggregation are all that change,
and each backward pass starts from zeroed gradients). Further arguments are config overrides
(``rollout.prompts_per_step=3``: groups dealt unevenly over DP 2)."""

from __future__ import annotations

import dataclasses
import sys

import torch

from megatron_offgrpo.algo import compute_group_advantages, reference_loss
from megatron_offgrpo.config import load_config
from megatron_offgrpo.model import output_weight
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._sync import share_samples
from megatron_offgrpo.train._step import backward_pass
from tests.train.conftest import TINY

G = 4


def reference_grads(trainer, samples, adv, params) -> dict[str, torch.Tensor]:
    """The whole step as one batch, logits materialised, algo's reference loss, plain autograd."""
    (mb,) = build_microbatches(samples, adv.advantages, adv.sample_valid, G, 0, 1, token_budget=10**9)
    model = trainer.policy.model
    hidden = model(mb.tokens, mb.positions, None)
    logits = hidden.reshape(-1, hidden.shape[-1]) @ output_weight(model).t()
    loss, _ = reference_loss(logits, mb.flat("targets"), mb.flat("behavior_logp"), mb.flat("advantages"),
                             mb.flat("loss_mask"), params, seq_ids=mb.flat("seq_ids"))
    names, tensors = zip(*model.named_parameters())
    return dict(zip(names, torch.autograd.grad(loss, tensors, allow_unused=True)))


def main() -> None:
    out_dir, aggregations = sys.argv[1], sys.argv[2].split(",")
    layouts, overrides = sys.argv[3].split(","), sys.argv[4:]
    config = load_config(None, TINY + [f"train.out_dir={out_dir}", f"algo.aggregation={aggregations[0]}", *overrides])
    trainer, rollout, log = setup(config)
    samples = share_samples(rollout.maker.generate(0).samples if rollout is not None else None)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    adv = compute_group_advantages(rewards, G, trainer.advantage)
    assert int(adv.sample_valid.sum()) >= G, "need groups with reward variance"
    for s in samples:  # off-policy: behavior log-probs that differ from the current policy, so ratios clip
        s.behavior_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(s.behavior_logprobs)]
    for layout in layouts:
        for aggregation in aggregations:
            check(trainer, samples, adv, dataclasses.replace(trainer.objective, aggregation=aggregation),
                  layout == "packed", config.rollout.prompts_per_step)
    if rollout is not None:
        rollout.close()
        log.close()


def check(trainer, samples, adv, objective, packed: bool, groups: int) -> None:
    """The trainer's gradient for ``objective`` (backward_pass zeroes the grad buffers first) against the reference."""
    expected = reference_grads(trainer, samples, adv, objective)
    ctx = trainer.ctx
    build = build_packed_microbatches if packed else build_microbatches
    mbs = build(samples, adv.advantages, adv.sample_valid, G, ctx.dp_rank, ctx.dp_size, token_budget=120)
    if groups % ctx.dp_size == 0 or ctx.dp_rank == 0:  # uneven: the other rank's one group may fit one pack
        assert len(mbs) >= 2, f"want several micro-batches per rank, got {len(mbs)}"
    if packed and (groups % ctx.dp_size == 0 or ctx.dp_rank == 0):
        rows = [int(mb.seq_ids.max()) for mb in mbs]  # sequences per pack (+ the pad tail's id)
        assert max(rows) >= 2, f"want packs of several sequences, got {rows}"
    backward_pass(trainer.policy.ddp, ctx, mbs, objective, global_token_count(samples, adv.sample_valid),
                  global_seq_count(adv.sample_valid))
    worst = 0.0
    for name, param in trainer.policy.model.named_parameters():
        ref = expected[name] if expected[name] is not None else torch.zeros_like(param)
        err = (param.main_grad - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
        worst = max(worst, err)
        assert err < 1e-5, f"{name}: relative grad error {err:.3g}"
    print(f"MATCH dp={ctx.dp_size} groups={groups} micro-batches={len(mbs)} packed={packed} "
          f"aggregation={objective.aggregation} worst relative error {worst:.2e}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
