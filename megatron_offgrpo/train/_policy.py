"""The trained policy on this rank: one PP stage of the megatron model, DDP, the megatron optimizer, the LR schedule.

Also the frozen copies the objective may need: the reference model (KL) and the behavior snapshot (exact
behavior log-probs, refreshed with the engine).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from megatron_offgrpo.config import Config, ConfigError, ModelConfig, OptimConfig
from megatron_offgrpo.model import (
    QwenArch,
    build_gpt_stage,
    compile_layers,
    expose_hidden_states,
    lora,
    precision,
)
from megatron_offgrpo.runtime import ParallelContext, have_te


@dataclasses.dataclass
class Policy:
    """Attributes: model (this rank's stage, hidden states exposed), ddp (megatron DDP around it), optimizer,
    scheduler (megatron ``OptimizerParamScheduler``)."""

    model: torch.nn.Module
    ddp: torch.nn.Module
    optimizer: object
    scheduler: object


def _stage(arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig,
           sequence_parallel: bool | None, trained: bool) -> torch.nn.Module:
    config = precision.precision_transformer_config(
        arch, ctx.tp_size, ctx.pp_size, model_cfg.precision, model_cfg.fp8_recipe, model_cfg.fp8_amax_history,
        model_cfg.fp8_margin, ctx.ep_size, model_cfg.moe_aux_loss_coef, model_cfg.router_replay, ctx.expert_tp_size,
        sequence_parallel)
    # the fused weight-gradient GEMMs add into DDP's main_grad, which only the trained stage has
    config.gradient_accumulation_fusion = trained and grad_accum_fusion(model_cfg)
    stage = build_gpt_stage(arch, config, ctx.is_first_stage, ctx.is_last_stage)
    return expose_hidden_states(stage)


def grad_accum_fusion(model_cfg: ModelConfig) -> bool:
    """``model.grad_accum_fusion`` resolved. None: on with Transformer Engine's layers (their weight-gradient GEMM
    accumulates into main_grad, megatron's own default), off on the local spec: its torch stand-in for apex's kernel
    measured no faster on an H200 (docs/benchmarks.md, "GPU validation": the fp32-output GEMM costs what the add it
    saves did), and under ``model.compile`` it writes the weight's main_grad inside autograd, which breaks each
    compiled layer's graph at every linear (2.4x slower)."""
    if model_cfg.grad_accum_fusion is not None:
        return model_cfg.grad_accum_fusion
    return have_te() and not model_cfg.compile


def load_initial_weights(stage: torch.nn.Module, arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig) -> None:
    """HF weights from ``model.hf_path`` (init=hf), or the model part of the megatron dist checkpoint at
    ``model.megatron_path`` (init=megatron; megatron reshards it to this run's layout; collective); init=random keeps
    megatron's seeded initialisation."""
    from checkpoint_tools import CheckpointError, dist_ckpt, load_hf_into_stage, open_safetensors_dir

    if model_cfg.init == "megatron":
        try:
            dist_ckpt.load_model_part(stage, dist_ckpt.resolve_checkpoint(model_cfg.megatron_path))
        except CheckpointError as exc:  # damage the preflight's metadata check cannot see: bad input, one line
            raise ConfigError(f"model.megatron_path={model_cfg.megatron_path}: {exc}") from None
        return
    if model_cfg.init != "hf":
        return

    load_hf_into_stage(stage, arch, open_safetensors_dir(Path(model_cfg.hf_path)), ctx.tp_size, ctx.tp_rank,
                       ctx.pp_size, ctx.pp_rank, ctx.ep_size, ctx.ep_rank, ctx.expert_tp_size, ctx.expert_tp_rank)


def adapter_spec(config: Config, arch: QwenArch) -> lora.LoraSpec | None:
    """The ``lora.*`` section for ``arch`` (None: full fine-tuning); A's draw follows ``parallel.seed``.

    Raises:
        ConfigError: targets the arch cannot take (one line).
    """
    c = config.lora
    try:
        return lora.lora_spec(arch, c.rank, c.alpha, c.dropout, c.targets, config.parallel.seed)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def build_policy(
    arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig, optim: OptimConfig, steps: int,
    sequence_parallel: bool | None = None, adapters: lora.LoraSpec | None = None,
) -> Policy:
    """The trainable stage with its DDP wrapper, optimizer and schedule (collective: every rank calls it);
    ``sequence_parallel`` as ``parallel.sequence_parallel``. With ``adapters`` (LoRA) the loaded weights are frozen
    and only the adapters train: DDP gives the base no gradient buffer and the optimizer no state."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    stage = _stage(arch, ctx, model_cfg, sequence_parallel, trained=True)
    load_initial_weights(stage, arch, ctx, model_cfg)
    if adapters is not None:
        lora.attach_lora(stage, adapters)
    if model_cfg.compile:
        compile_layers(stage, model_cfg.compile_mode)
    ddp = DistributedDataParallel(
        stage.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=optim.distributed_optimizer),
        module=stage,
    )
    # The schedules reduce DP grads (and tied-embedding grads across PP, and under sequence parallelism the norm and
    # router grads of each rank's positions across TP) only through this hook.
    stage.config.finalize_model_grads_func = finalize_model_grads
    bf16 = model_cfg.precision in ("bf16", "fp8")
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
                        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, clip_grad=optim.clip_grad,
                        bf16=bf16, params_dtype=precision.params_dtype(model_cfg.precision),
                        use_distributed_optimizer=optim.distributed_optimizer),
        [ddp],
    )
    use_fused_adam(optimizer)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if optim.warmup_steps else optim.lr, max_lr=optim.lr, min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps, lr_decay_steps=max(steps, optim.warmup_steps + 1),
        lr_decay_style="cosine" if optim.min_lr < optim.lr else "constant", start_wd=optim.weight_decay,
        end_wd=optim.weight_decay, wd_incr_steps=max(steps, 1), wd_incr_style="constant",
    )
    return Policy(stage, ddp, optimizer, scheduler)


def use_fused_adam(optimizer) -> list:
    """Switch the torch Adam/AdamW that megatron falls back to without TE or apex (every CPU run; a GPU image without
    them) to torch's fused kernel; returns the torch optimizers switched. Megatron builds them without ``fused``, so
    torch takes its multi-tensor path: on this 2-core CPU 217 ms a step for 20 M parameters against 58 ms fused; on
    an H200 10 ms of a 0.5B step's 262 ms of kernels. The same update up to rounding; TE's or apex's FusedAdam (not
    torch optimizers) are left alone."""
    switched = []
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(wrapper, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                group["foreach"], group["fused"] = False, True
            switched.append(inner)
    return switched


@dataclasses.dataclass
class FrozenPolicy:
    """A frozen policy to score tokens with (the KL reference, the behavior snapshot).

    Attributes:
        model: a whole stage of its own (full fine-tuning), or, with LoRA, the trained stage itself, scored under
            ``adapters``: no second copy of the base, only of the adapters.
        adapters: LoRA: the adapter values to score with (``model.lora.scored_with``: a copy taken by ``follow``, or
            None for the base alone: the initial policy).
        shares_base: whether ``model`` is the trained stage.
    """

    model: torch.nn.Module
    adapters: dict[str, torch.Tensor] | None = None
    shares_base: bool = False

    def scoring(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The model to score with, for the length of a ``with``."""
        return lora.scored_with(self.model, self.adapters) if self.shares_base else contextlib.nullcontext(self.model)

    def follow(self, source: torch.nn.Module) -> None:
        """Take ``source``'s current weights (the snapshot, after a refresh)."""
        if self.shares_base:
            self.adapters = {name: p.detach().clone() for name, p in lora.adapter_parameters(source).items()}
        else:
            copy_weights(source, self.model)


def frozen_policy(source: torch.nn.Module, arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig,
                  initial: bool) -> FrozenPolicy:
    """``source``'s policy frozen now: the reference (``initial``: with LoRA, the base alone) or the snapshot."""
    if lora.adapter_parameters(source):
        frozen = FrozenPolicy(source, None, shares_base=True)
        if not initial:
            frozen.follow(source)
        return frozen
    return FrozenPolicy(frozen_copy(source, arch, ctx, model_cfg))


def frozen_copy(
    source: torch.nn.Module, arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig
) -> torch.nn.Module:
    """A non-trainable stage with ``source``'s weights and layout."""
    copy = _stage(arch, ctx, model_cfg, source.config.sequence_parallel, trained=False).eval()
    copy_weights(source, copy)
    for param in copy.parameters():
        param.requires_grad_(False)
    return copy


def frozen_from_weights(arch: QwenArch, ctx: ParallelContext, model_cfg: ModelConfig,
                        sequence_parallel: bool | None) -> torch.nn.Module:
    """A non-trainable stage of ``arch`` at this run's layout with the weights ``model_cfg`` names (a teacher; every
    rank calls it)."""
    stage = _stage(arch, ctx, model_cfg, sequence_parallel, trained=False).eval()
    load_initial_weights(stage, arch, ctx, model_cfg)
    for param in stage.parameters():
        param.requires_grad_(False)
    return stage


@torch.no_grad()
def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Copy every parameter of ``source`` into ``target`` (same layout)."""
    target_params = dict(target.named_parameters())
    for name, param in source.named_parameters():
        target_params[name].copy_(param)
