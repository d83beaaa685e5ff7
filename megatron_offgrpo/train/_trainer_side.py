"""The trainer's side of the wall, on every rank: the policy (stage, DDP, optimizer, schedule), the frozen snapshot
and reference, and what they do with a step's samples. It takes ``list[Sample]`` in and gives weight buckets out;
it never sees the engine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from checkpoint_tools import adapters as ckpt_adapters
from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Sample
from megatron_offgrpo.model import QwenArch, load_arch, output_weight
from megatron_offgrpo.rollout import probes
from megatron_offgrpo.runtime import BackgroundSave, ParallelContext, init_parallel, release_free_memory
from megatron_offgrpo.transports import Buckets, adapters, deltas
from megatron_offgrpo.train._batch import (
    MicroBatch,
    build_microbatches,
    global_seq_count,
    global_token_count,
    round_up,
)
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches
from megatron_offgrpo.train._delta_sync import DeltaSender
from megatron_offgrpo.train._checkpoint import TrainerState, load_checkpoint, resume_schedule, save_checkpoint
from megatron_offgrpo.train._policy import FrozenPolicy, Policy, adapter_spec, build_policy, frozen_policy
from megatron_offgrpo.train._router_load import RouterLoad
from megatron_offgrpo.train._step import Learned, policy_step, sequence_shard, token_logprobs
from megatron_offgrpo.train._teacher import Teacher
from megatron_offgrpo.train._weights import (export_adapter_dir, export_buckets, export_hf_dir, hf_extra_dirs,
                                             model_card)

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainerSide:
    """This rank's share of the learner.

    Attributes:
        snapshot: the weights the engine serves (``rollout.behavior_logprobs=recompute``): exact behavior log-probs.
        reference: the initial policy (``algo.kl_beta > 0``): the KL term's log-probs.
        teacher: on-policy distillation's frozen teacher (``distill.teacher_path``: scores every sampled token), or its
            settings (``distill.teacher_fleet``: the samples bring the scores).
        router_load: MoE models: counts each step's routing (the ``moe_*`` metrics).
        delta: ``rollout.sync=delta``, on global rank 0: the image of the last version sent, what deltas measure from.
        refresh_metrics: the figures of the refreshes since the last step's record (``_sync.refresh_metrics``).
        background: ``train.async_save``: the checkpoint written in the background, if one is.
    """

    config: Config
    ctx: ParallelContext
    arch: QwenArch
    policy: Policy
    objective: ObjectiveParams
    advantage: AdvantageParams
    snapshot: FrozenPolicy | None = None
    reference: FrozenPolicy | None = None
    teacher: Teacher | None = None
    router_load: RouterLoad | None = None
    delta: DeltaSender | None = None
    refresh_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last delta-mode refresh's
    background: BackgroundSave | None = None

    @classmethod
    def build(cls, config: Config) -> TrainerSide:
        """Initialise the process groups and build the policy and its frozen copies (collective)."""
        ctx = init_parallel(config.parallel.tp, config.parallel.pp, config.parallel.seed, ep=config.parallel.ep,
                            etp=config.parallel.etp)
        torch.use_deterministic_algorithms(config.train.deterministic)
        arch = load_arch(config.model.hf_path)
        adapters = adapter_spec(config, arch)
        policy = build_policy(arch, ctx, config.model, config.optim, config.train.steps,
                              config.parallel.sequence_parallel, adapters)
        side = cls(config, ctx, arch, policy, config.algo.objective_params(config.rollout.drgrpo_constant()),
                   config.algo.advantage_params())
        if config.rollout.behavior_logprobs == "recompute":
            side.snapshot = frozen_policy(policy.model, arch, ctx, config.model, initial=False)
        if config.algo.kl_beta > 0:
            side.reference = frozen_policy(policy.model, arch, ctx, config.model, initial=True)
        if config.distill.on:
            side.teacher = Teacher.build(config, ctx, arch)
        if config.train.async_save:
            side.background = BackgroundSave(ctx.device)
        if arch.is_moe:
            side.router_load = RouterLoad(policy.model, arch.num_layers, arch.num_experts)
        if config.rollout.sync == "delta" and ctx.rank == 0:  # where the export's buckets arrive
            dtype = config.rollout.serving_dtype(config.model.precision)
            side.delta = DeltaSender(getattr(torch, dtype), config.rollout.full_sync_every,
                                     config.rollout.bucket_mb * 1024**2, config.rollout.delta_compression)
        return side

    def learn(self, samples: Sequence[Sample]) -> Learned:
        """One optimizer step on a step's samples (every rank holds them all): group advantages, this DP rank's
        micro-batches, behavior and reference log-probs, the clipped objective. Returns its metrics and skip."""
        cfg, ctx = self.config, self.ctx
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        adv = compute_group_advantages(rewards, cfg.rollout.group_size, self.advantage)
        valid = adv.sample_valid
        if self.teacher is not None:  # every sampled token carries the teacher's signal, whatever its group's rewards
            valid = torch.ones_like(valid)
        if cfg.rollout.mask_truncated:  # overlong filtering: a cut response leaves the loss, not the baseline
            valid = valid & torch.tensor([s.finish_reason != "length" for s in samples])
        build = (build_shared_prompt_microbatches if cfg.optim.shared_prompt else
                 build_packed_microbatches if cfg.optim.packing else build_microbatches)
        microbatches = build(samples, adv.advantages, valid, cfg.rollout.group_size, ctx.dp_rank, ctx.dp_size,
                             cfg.optim.micro_batch_tokens, device=ctx.device,
                             seq_multiple=sequence_shard(self.policy.model, ctx)[1])
        self.fill_logprobs(microbatches)
        distill = self.teacher.apply(ctx, microbatches, cfg.rollout.temperature) if self.teacher else {}
        with self.router_load.counting() if self.router_load else contextlib.nullcontext():
            result = policy_step(self.policy.ddp, self.policy.optimizer, ctx, microbatches, self.objective,
                                 global_token_count(samples, valid), global_seq_count(valid), cfg.rollout.temperature)
        if not result.skipped:
            self.policy.scheduler.step(increment=1)
        release_free_memory()  # the step's loss chunks and grads: not kept beside the next generation's buffers
        routing = self.router_load.metrics(ctx, len(microbatches)) if self.router_load else {}
        return Learned({"loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped,
                        "lr": self.policy.optimizer.param_groups[0]["lr"], **adv.metrics(), **result.metrics,
                        **routing, **distill}, result.skipped)

    def fill_logprobs(self, microbatches: Sequence[MicroBatch]) -> None:
        """Exact behavior log-probs (from the snapshot of the pushed weights) and reference log-probs, in place."""
        temperature = self.config.rollout.temperature
        if self.snapshot is not None:
            with self.snapshot.scoring() as model:
                for mb, logp in zip(microbatches, token_logprobs(model, self.ctx, microbatches, temperature)):
                    mb.behavior_logp = torch.where(mb.loss_mask, logp, mb.behavior_logp)
        if self.reference is not None:
            with self.reference.scoring() as model:
                for mb, logp in zip(microbatches, token_logprobs(model, self.ctx, microbatches, temperature)):
                    mb.ref_logp = logp

    def weight_buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The policy as HF-named buckets (with LoRA: merged), yielded on global rank 0; every rank must iterate
        (collective)."""
        return export_buckets(self.policy.model, self.arch, self.ctx, self.config.rollout.bucket_mb * 1024**2)

    def engine_adapter(self) -> adapters.AdapterSpec | None:
        """The adapter the engines serve beside the base (``lora.sync=adapter``), in HF module names; None when they
        serve whole weights (full fine-tuning, or ``lora.sync=merged``)."""
        lora = self.config.lora
        if not lora.rank or lora.sync != "adapter":
            return None
        return adapters.AdapterSpec(lora.rank, lora.alpha, ckpt_adapters.hf_target_modules(self.arch, lora.targets))

    def refresh_payload(self, version: int) -> Buckets | adapters.AdapterPayload | deltas.DeltaPayload:
        """What a refresh to ``version`` sends the engines: the whole (merged) policy, or with ``lora.sync=adapter``
        its adapter alone (PEFT-named buckets; a few MB), or with ``rollout.sync=delta`` (on global rank 0) the
        changes since the last version sent, or that version whole (``train._delta_sync``: the reason is logged);
        every rank must drain its buckets (collective)."""
        spec = self.engine_adapter()
        if spec is None and self.delta is not None:
            payload, reason = self.delta.payload(self.weight_buckets(), version)
            if reason:
                logger.info("refresh to version %d: a full sync (%s)", version, reason)
            return payload
        if spec is None:
            return self.weight_buckets()
        return adapters.AdapterPayload(spec, export_buckets(self.policy.model, self.arch, self.ctx,
                                                            self.config.rollout.bucket_mb * 1024**2, adapter="only"))

    def weights_pushed(self, version: int, full_sync: dict[str, str] | None = None, delta: bool = False) -> None:
        """The engine now serves the current weights as ``version`` (verified): the snapshot follows (exact behavior
        log-probs), and the delta image becomes the base of the next delta (``delta``: this refresh was one;
        ``full_sync``: engines that refused it and got it whole)."""
        if self.delta is not None:
            self.delta.pushed(version, full=not delta, refused=full_sync or {})
        if self.snapshot is not None:
            self.snapshot.follow(self.policy.model)

    def probe_logprobs(self, probe_ids: list[int]) -> list[float]:
        """The policy's log-probs of ``probe_ids`` on every rank (collective): what a refreshed engine must match."""
        return probe_logprobs(self.policy.model, self.ctx, probe_ids)

    def probe_bound(self) -> float:
        """``rollout.probes.probe_bound`` of the current weights: the most an fp32 engine may differ from
        ``probe_logprobs`` (collective)."""
        return probes.probe_bound(self.arch.vocab_size, self.arch.hidden_size, logit_bound(self.policy.model, self.ctx))

    def export_hf(self, out: Path) -> Path | None:
        """The current policy as a HF directory at ``out`` (atomic, replaces an older one; collective; rank 0
        returns it)."""
        return export_hf_dir(self.policy.model, self.arch, self.ctx, out, Path(self.config.model.hf_path))

    def export_adapter(self, out: Path) -> Path | None:
        """LoRA: the policy's adapter as a PEFT directory at ``out`` (``peft.PeftModel.from_pretrained`` on the base
        at ``model.hf_path``); None without LoRA, and on ranks other than 0 (collective)."""
        if not self.config.lora.rank:
            return None
        return export_adapter_dir(self.policy.model, self.arch, self.ctx, out, self.config.model.hf_path)

    def save(self, step: int, version: int, rollout_state: object = None, log_tail: dict | None = None) -> None:
        """Checkpoint after ``step`` steps, the engine serving ``version``, with the rollout side's ``rollout_state``
        and the metrics log's ``log_tail`` (collective; rank 0's are written)."""
        source = Path(self.config.model.hf_path)
        state = TrainerState(step, version, self.policy.scheduler.state_dict(), self.config.to_dict())
        save_checkpoint(self.config.train.out_dir, self.policy.model, self.policy.optimizer, state,
                        card=model_card(self.policy.model, self.arch, self.ctx, source),
                        extra_dirs=hf_extra_dirs(source), rollout_state=rollout_state, log_tail=log_tail,
                        background=self.background)

    def saved(self, wait: str | None = None) -> None:
        """``train.async_save``: publish the checkpoint written in the background once every rank's writer is done,
        with ``wait`` (why) waiting for it (collective; a failed write: ``runtime.SaveFailed`` on every rank)."""
        if self.background is not None:
            self.background.finish(wait) if wait else self.background.poll()

    def restore(self, checkpoint: Path) -> TrainerState:
        """Model, optimizer, RNG and LR schedule from ``checkpoint``; returns its saved state (collective)."""
        self.saved("before a load")
        state = load_checkpoint(checkpoint, self.policy.model, self.policy.optimizer)
        resume_schedule(self.policy.scheduler, state.scheduler)
        return state


def logit_bound(model: torch.nn.Module, ctx: ParallelContext) -> float:
    """``sqrt(H) max|g| max_j ||W_j||`` on every rank (collective): >= ``||h|| ||W_j||`` for any position, since the
    final RMSNorm's output is ``g * x / rms(x)`` with ``||x / rms(x)|| = sqrt(H)`` (its epsilon only shrinks it)."""
    local = torch.zeros((), dtype=torch.float64, device=ctx.device)
    if model.post_process:  # the last stage holds the final norm and the output layer (TP: a vocabulary shard)
        norm = model.decoder.final_layernorm.weight.detach()
        rows = output_weight(model).detach().double().norm(dim=1).max()
        local = rows * norm.double().abs().max() * norm.numel() ** 0.5
    for group in (ctx.tp_group, ctx.pp_group):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return float(local)


def probe_logprobs(model: torch.nn.Module, ctx: ParallelContext, probe_ids: list[int]) -> list[float]:
    """``model``'s log p(probe[t] | probe[:t]), t >= 1, on every rank (collective).

    At temperature 1 whatever the sampling temperature: engines score a given sequence (vLLM's prompt log-probs)
    with the raw distribution, and the probe checks the weights, not the sampler.
    """
    n = len(probe_ids) - 1
    # under sequence parallelism the row is split over TP: pad it (pad ids 0, after the probe: causal attention keeps
    # them out of the probe's log-probs)
    s = round_up(n, sequence_shard(model, ctx)[1])
    ids = torch.zeros(1, s, dtype=torch.long)
    targets = torch.zeros_like(ids)
    ids[0, :n], targets[0, :n] = torch.tensor(probe_ids[:-1]), torch.tensor(probe_ids[1:])
    zeros = torch.zeros_like(ids, dtype=torch.float32)
    mb = MicroBatch(ids, torch.arange(s).unsqueeze(0), targets, torch.arange(s).unsqueeze(0) < n, zeros, zeros, zeros,
                    torch.zeros_like(ids)).to(ctx.device)
    out = token_logprobs(model, ctx, [mb], temperature=1.0, exact=True)  # the same at every TP size
    logp = out[0].reshape(-1)[:n].double() if out else torch.zeros(n, dtype=torch.float64, device=ctx.device)
    if ctx.tp_rank != 0:
        logp = torch.zeros_like(logp)  # TP ranks hold copies: count one
    dist.all_reduce(logp, group=ctx.pp_group)  # only the last stage computed it
    return logp.tolist()
