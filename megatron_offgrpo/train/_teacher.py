"""On-policy distillation's teacher: a frozen model whose log-prob of every sampled token, against the behavior
policy's, is the distillation advantage.

Where it runs, one of two places (``distill``):
- ``teacher_path``: on the trainer's ranks at the student's TP/PP layout, in the same megatron schedule as the
  reference model's forward (``token_logprobs``), over the step's own micro-batches: the tokens are already where the
  loss is computed, and its forward (at the loss's positions only) cost a third of a training step on the CPU task
  (docs/benchmarks.md, "On-policy distillation": 0.27-0.46 s against 1.0-1.5 s). It takes trainer memory and time,
  and the teacher must split at the student's layout.
- ``teacher_fleet``: on a fleet of its own (``rollout.TeacherFleet``), any size and layout, scored when the samples
  are generated (beside the training in ``rollout.mode=async``); the samples bring the log-probs
  (``Sample.teacher_logprobs`` -> ``MicroBatch.teacher_logp``). It costs a second served model and the sequences'
  round trip.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_offgrpo.algo import distill_advantages, reverse_kl_sums
from megatron_offgrpo.config import Config, ConfigError
from megatron_offgrpo.model import QwenArch, load_arch, resolve_model_dir
from megatron_offgrpo.runtime import ParallelContext
from megatron_offgrpo.train._batch import MicroBatch
from megatron_offgrpo.train._policy import frozen_from_weights
from megatron_offgrpo.preflight import teacher_errors
from megatron_offgrpo.train._step import token_logprobs


@dataclasses.dataclass
class Teacher:
    """The frozen teacher stage of this rank (None: a teacher's fleet scored the samples) and the distillation
    settings."""

    model: torch.nn.Module | None
    weight: float
    reward_weight: float
    discount: float

    @classmethod
    def build(cls, config: Config, ctx: ParallelContext, student: QwenArch) -> Teacher:
        """Load ``distill.teacher_path`` at this run's layout (collective), or, with ``distill.teacher_fleet``, the
        settings alone (the samples bring the teacher's log-probs).

        Raises:
            ConfigError: a teacher that cannot score the student's tokens at this layout.
        """
        d = config.distill
        if d.teacher_fleet:
            return cls(None, d.weight, d.reward_weight, d.discount)
        path = resolve_model_dir(d.teacher_path)
        arch = load_arch(path)
        errors = teacher_errors(arch, student, ctx.tp_size, ctx.pp_size, ctx.ep_size, config.parallel.etp)
        if errors:  # preflight said so before any process started; a teacher changed since is refused here
            raise ConfigError("; ".join(errors))
        model_cfg = dataclasses.replace(config.model, hf_path=str(path), init="hf", megatron_path=None, compile=False,
                                        router_replay=False)
        model = frozen_from_weights(arch, ctx, model_cfg, config.parallel.sequence_parallel)
        return cls(model, d.weight, d.reward_weight, d.discount)

    def apply(self, ctx: ParallelContext, microbatches: Sequence[MicroBatch], temperature: float) -> dict[str, float]:
        """Score the micro-batches (or read the fleet's scores they carry) and turn their advantages into
        ``reward_weight * A_reward + weight * A_distill`` (in place, on the last stage, where the loss is computed);
        returns ``teacher_kl`` (the mean per-token reverse-KL estimate over the step's trained tokens, every rank)
        and, when it scored them here, ``teacher_s`` (a fleet's scoring time comes with the samples)."""
        start = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        if self.model is not None:
            scored = token_logprobs(self.model, ctx, microbatches, temperature)
        elif any(mb.teacher_logp is None for mb in microbatches):
            raise RuntimeError("distill.teacher_fleet: a step's samples came without the teacher's log-probs")
        else:  # the last stage's, as token_logprobs gives them: the loss and the KL sums are computed there alone
            scored = [mb.teacher_logp for mb in microbatches] if ctx.is_last_stage else []
        for mb, logp in zip(microbatches, scored):
            distill = distill_advantages(logp.reshape(-1), mb.flat("behavior_logp"), mb.flat("loss_mask"),
                                         mb.flat("seq_ids"), self.discount).reshape(mb.advantages.shape)
            mb.advantages = self.reward_weight * mb.advantages + self.weight * distill.to(mb.advantages.dtype)
            sums += reverse_kl_sums(logp.reshape(-1), mb.flat("behavior_logp"), mb.flat("loss_mask"))
        # only the last stage scored; TP ranks hold identical copies: sum over PP, then over DP
        for group in (ctx.pp_group, ctx.dp_group):
            dist.all_reduce(sums, group=group)
        total, count = sums.tolist()
        seconds = {"teacher_s": time.perf_counter() - start} if self.model is not None else {}
        return {"teacher_kl": total / max(count, 1.0), **seconds}
