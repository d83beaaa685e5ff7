"""On-policy distillation's teacher: a frozen model on the trainer's ranks that scores every sampled token once a step.

Where it runs: on the trainer's ranks at the student's TP/PP layout, in the same megatron schedule as the reference
model's forward (``token_logprobs``), over the step's own micro-batches. The alternative, the fleet's engines scoring
the sequences with prompt log-probs, needs a second served model and sends every sequence out and the log-probs back;
here the tokens are already where the loss is computed, and its forward (at the loss's positions only) cost a third of
a training step on the CPU task (README "On-policy distillation": 0.27-0.46 s against 1.0-1.5 s).
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
from megatron_offgrpo.train._preflight import teacher_errors
from megatron_offgrpo.train._step import token_logprobs


@dataclasses.dataclass
class Teacher:
    """The frozen teacher stage of this rank and the distillation settings."""

    model: torch.nn.Module
    weight: float
    reward_weight: float
    discount: float

    @classmethod
    def build(cls, config: Config, ctx: ParallelContext, student: QwenArch) -> Teacher:
        """Load ``distill.teacher_path`` at this run's layout (collective).

        Raises:
            ConfigError: a teacher that cannot score the student's tokens at this layout.
        """
        d = config.distill
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
        """Score the micro-batches and turn their advantages into ``reward_weight * A_reward + weight * A_distill``
        (in place, on the last stage, where the loss is computed); returns ``teacher_kl`` (the mean per-token
        reverse-KL estimate over the step's trained tokens, every rank) and ``teacher_s``."""
        start = time.perf_counter()
        sums = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        for mb, logp in zip(microbatches, token_logprobs(self.model, ctx, microbatches, temperature)):
            distill = distill_advantages(logp.reshape(-1), mb.flat("behavior_logp"), mb.flat("loss_mask"),
                                         mb.flat("seq_ids"), self.discount).reshape(mb.advantages.shape)
            mb.advantages = self.reward_weight * mb.advantages + self.weight * distill.to(mb.advantages.dtype)
            sums += reverse_kl_sums(logp.reshape(-1), mb.flat("behavior_logp"), mb.flat("loss_mask"))
        # only the last stage scored; TP ranks hold identical copies: sum over PP, then over DP
        for group in (ctx.pp_group, ctx.dp_group):
            dist.all_reduce(sums, group=group)
        total, count = sums.tolist()
        return {"teacher_kl": total / max(count, 1.0), "teacher_s": time.perf_counter() - start}
