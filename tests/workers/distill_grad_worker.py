"""torchrun worker: a distillation step's loss and gradient (teacher scored at this layout, fused kernel, megatron DDP)
equal a written-out reference in float64: the HF student and teacher in one process, each token's advantage
``reward_weight x A_group + weight x discounted sum of (log pi_teacher - log pi_behavior)`` from the HF teacher's
log-probs, ``algo.reference_loss`` on materialised logits, plain autograd. The trainer's gradient is read back under
HF names through the same export a refresh uses (each parameter's main_grad put in its place).

argv: out_dir student_dir teacher_dir, then config overrides (the layout: parallel.tp=2 or parallel.pp=2)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from megatron_offgrpo.algo import compute_group_advantages, distill_advantages, reference_loss
from megatron_offgrpo.config import load_config
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._step import backward_pass, sequence_shard
from megatron_offgrpo.train._sync import share_samples
from tests.train.conftest import TINY

G = 4
WEIGHT, REWARD_WEIGHT, DISCOUNT = 1.0, 0.5, 0.5


def trainer_grads(trainer) -> dict[str, torch.Tensor]:
    """HF name -> the trainer's gradient (global rank 0; collective): the export of main_grad in the weights' place."""
    params = list(trainer.policy.model.parameters())
    weights = [p.data for p in params]
    for p in params:
        p.data = p.main_grad
    try:
        return {name: t.double().clone() for bucket in trainer.weight_buckets() for name, t in bucket}
    finally:
        for p, w in zip(params, weights):
            p.data = w


def reference(student: str, teacher: str, samples, adv, valid, objective) -> tuple[float, dict[str, torch.Tensor]]:
    """The step's loss and HF-named gradient in float64, one process."""
    (mb,) = build_microbatches(samples, adv.advantages, valid, G, 0, 1, token_budget=10**9)
    policy = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float64)
    scorer = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float64).eval()
    targets, mask, seq_ids = mb.flat("targets"), mb.flat("loss_mask"), mb.flat("seq_ids")
    with torch.no_grad():
        teacher_logp = scorer(mb.tokens).logits.reshape(-1, scorer.config.vocab_size).log_softmax(-1)
        teacher_logp = teacher_logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    behavior = mb.flat("behavior_logp").double()
    advantages = REWARD_WEIGHT * mb.flat("advantages").double() + WEIGHT * distill_advantages(
        teacher_logp, behavior, mask, seq_ids, DISCOUNT)
    logits = policy(mb.tokens).logits.reshape(-1, policy.config.vocab_size)
    loss, _ = reference_loss(logits, targets, behavior, advantages, mask, objective, seq_ids=seq_ids)
    names, tensors = zip(*policy.named_parameters())
    return float(loss), dict(zip(names, torch.autograd.grad(loss, tensors)))


def main() -> None:
    out_dir, student, teacher, *overrides = sys.argv[1:]
    config = load_config(None, TINY + [f"train.out_dir={out_dir}", f"model.hf_path={student}", "model.init=hf",
                                       f"distill.teacher_path={teacher}", f"distill.weight={WEIGHT}",
                                       f"distill.reward_weight={REWARD_WEIGHT}", f"distill.discount={DISCOUNT}",
                                       *overrides])
    trainer, rollout, log = setup(config)
    samples = share_samples(rollout.maker.generate(0).samples if rollout is not None else None)
    for s in samples:  # off-policy: behavior log-probs away from the policy's, so ratios clip
        s.behavior_logprobs = [x + 0.3 * ((i % 3) - 1) for i, x in enumerate(s.behavior_logprobs)]
    adv = compute_group_advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64), G,
                                   trainer.advantage)
    valid = torch.ones(len(samples), dtype=torch.bool)  # with a teacher every sample trains
    ctx = trainer.ctx
    mbs = build_microbatches(samples, adv.advantages, valid, G, ctx.dp_rank, ctx.dp_size, token_budget=120,
                             device=ctx.device, seq_multiple=sequence_shard(trainer.policy.model, ctx)[1])
    metrics = trainer.teacher.apply(ctx, mbs, config.rollout.temperature)
    loss, _ = backward_pass(trainer.policy.ddp, ctx, mbs, trainer.objective, global_token_count(samples, valid),
                            global_seq_count(valid))
    got = trainer_grads(trainer)
    if dist.get_rank() == 0:
        want_loss, want = reference(student, teacher, samples, adv, valid, trainer.objective)
        assert abs(float(loss) - want_loss) <= 1e-5 * max(abs(want_loss), 1.0), (float(loss), want_loss)
        worst = 0.0
        for name, ref in want.items():
            err = (got[name] - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12)
            worst = max(worst, err)
            assert err < 1e-4, f"{name}: relative grad error {err:.3g}"
        assert set(got) == set(want), sorted(set(got) ^ set(want))
        print(f"MATCH tp={ctx.tp_size} pp={ctx.pp_size} loss {float(loss):.6f} vs {want_loss:.6f}, teacher_kl "
              f"{metrics['teacher_kl']:.4f}, worst relative grad error {worst:.2e} over {len(want)} tensors")
    if rollout is not None:
        rollout.close()
        log.close()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
