"""One optimizer step of the policy over megatron's forward-backward schedule, with the fused GRPO loss.

The loss closure receives the last stage's hidden states ``[b, s, H]`` (see ``model.expose_hidden_states``), keeps
only the rows that enter the loss (response tokens of valid samples: prompts never reach the output GEMM), and
calls ``kernels.fused_linear_grpo_loss`` with this rank's output-layer shard and the TP group. Under sequence
parallelism the stage gathers the row's positions before handing them over, so the closure sees the same ``[b, s, H]``
(rows are padded to a multiple of tp by the layouts' ``seq_multiple``; pads never enter the loss).

Normalisation: each micro-batch's loss is ``local_sum / global_normaliser`` (the normaliser counted over the whole
step and every DP rank). Megatron divides the closure's loss by the number of micro-batches and DDP averages
grads over DP; the closure multiplies by both, so the gradient is exactly that of the global objective.

Devices: the micro-batches must already be on ``ctx.device`` (``build_microbatches(..., device=ctx.device)`` or
``MicroBatch.to``); the running totals live there too, since the closure adds device tensors into them and NCCL
all-reduces only CUDA tensors. ``policy_step``'s results leave as Python floats.

Host synchronisation: from the first forward to the end of the backward the host never waits for the device, so it
queues kernels ahead and the schedule never drains the GPU. What would need a value (which rows enter the loss,
the targets' range) is found on the CPU when the micro-batch is built (``MicroBatch.loss_rows``/``target_bounds``);
metrics stay device tensors and are read once per step, in one transfer (``_read_once``), before the optimizer step
(which reads the grad norm: megatron's clipping). The default objective is covered by
``tests/train/test_step_syncs.py`` (CPU) and its GPU twin under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from megatron_offgrpo.algo import ObjectiveParams, loss_parts
from megatron_offgrpo.kernels import fused_linear_grpo_loss, vocab_parallel_logprobs
from megatron_offgrpo.model import output_weight
from megatron_offgrpo.runtime import ParallelContext
from megatron_offgrpo.train._batch import MicroBatch

SUMMED_METRICS = ("token_count", "clip_low_count", "clip_high_count", "dual_clip_count", "kl_sum", "entropy_sum",
                  "log_ratio_abs_sum", "tis_unit_count", "tis_raw_sum", "tis_truncated_count", "tis_weight_sum")


@dataclasses.dataclass
class StepResult:
    """What one optimizer step reports (identical on every rank)."""

    loss: float
    metrics: dict[str, float]
    grad_norm: float
    skipped: bool


@dataclasses.dataclass(frozen=True)
class Learned:
    """What ``TrainerSide.learn`` hands the loop for one step.

    Attributes:
        metrics: the step's metrics, as logged (``skipped`` among them, 0/1 in the records).
        skipped: the loss was not finite: no update (``train.max_nonfinite_steps`` in a row stop the run).
    """

    metrics: dict[str, float]
    skipped: bool


def _selected(mb: MicroBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Hidden rows and per-token fields of the positions that enter the loss (one masked row if none do)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    rows = mb.loss_rows if mb.loss_rows is not None else mb.flat("loss_mask").nonzero().squeeze(1)
    if rows.numel() == 0:
        # keep the graph: PP backward needs a grad for every stage
        rows = torch.zeros(1, dtype=torch.long, device=h.device)
    fields = {k: mb.flat(k).index_select(0, rows) for k in ("targets", "behavior_logp", "advantages", "loss_mask",
                                                           "fleet_logp", "seq_ids")}
    if mb.ref_logp is not None:
        fields["ref_logp"] = mb.ref_logp.reshape(-1).index_select(0, rows)
    return h.index_select(0, rows), fields


def _check_devices(microbatches: Sequence[MicroBatch], device: torch.device) -> None:
    """Raise a ValueError naming the fix when a micro-batch tensor is not on ``device`` (checked once here,
    rather than failing deep inside megatron's forward or in an NCCL call)."""
    for i, mb in enumerate(microbatches):
        stray = {f.name: str(getattr(mb, f.name).device) for f in dataclasses.fields(mb)
                 if isinstance(getattr(mb, f.name), torch.Tensor) and getattr(mb, f.name).device != device}
        if stray:
            raise ValueError(f"micro-batch {i} has tensors {stray} off the model's device {device}: build it with "
                             "build_microbatches(..., device=ctx.device) or move it with MicroBatch.to(ctx.device)")


def sequence_shard(model, ctx: ParallelContext) -> tuple[int, int]:
    """``(part, parts)``: which of the equal parts of every row's positions this rank holds inside ``model``'s
    sequence-parallel regions, ``(tp rank, tp)`` under sequence parallelism, else ``(0, 1)`` (the whole row).
    ``model``: a stage or its DDP wrapper (both carry megatron's config)."""
    return (ctx.tp_rank, ctx.tp_size) if model.config.sequence_parallel else (0, 1)


def _check_row_length(microbatches: Sequence[MicroBatch], parts: int) -> None:
    """Raise a ValueError naming the fix when rows cannot be split into ``parts`` equal sequence-parallel parts (the
    layouts pad them: ``seq_multiple``), rather than failing deep inside megatron's scatter."""
    s = microbatches[0].tokens.shape[1]
    if s % parts:
        raise ValueError(f"micro-batch rows of {s} positions under sequence parallelism over {parts} TP ranks: rows "
                         f"must be a multiple of {parts} (build them with seq_multiple={parts})")


def run_schedule(model, microbatches: Sequence[MicroBatch], loss_closure: Callable, forward_only: bool,
                 device: torch.device, shard: tuple[int, int] = (0, 1)) -> None:
    """Drive megatron's forward-backward schedule over ``microbatches`` with ``loss_closure(mb, hidden)``;
    ``shard`` as ``sequence_shard``.

    Raises:
        ValueError: a micro-batch tensor is not on ``device`` (the model's, ``ParallelContext.device``), or its rows
            do not split into ``shard[1]`` parts.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _check_devices(microbatches, device)
    _check_row_length(microbatches, shard[1])

    def forward_step(data_iterator, stage):
        mb = next(data_iterator)
        replay_routing(stage, mb.routed_experts, shard)
        out = stage(mb.tokens, mb.positions, mb.attention_mask, **_padding_kwargs(stage, mb.padding, shard))
        return out, lambda hidden: loss_closure(mb, hidden)

    first = microbatches[0]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=first.tokens.shape[1],
        micro_batch_size=first.tokens.shape[0],
        forward_only=forward_only,
    )


def _padding_kwargs(stage: torch.nn.Module, padding: torch.Tensor | None, shard: tuple[int, int]) -> dict:
    """The ``padding_mask`` argument of a MoE stage's forward (megatron's: True = pad, kept out of the routers'
    load-balancing loss and token counts), or nothing for a dense stage or a micro-batch without pads.

    Megatron splits the mask along the sequence in the embedding stage only (under sequence parallelism): a later
    pipeline stage is given this rank's part ``shard`` of the positions already.
    """
    from megatron.core.utils import get_attr_wrapped_model

    if padding is None or not stage.config.num_moe_experts:
        return {}
    if shard[1] > 1 and not get_attr_wrapped_model(stage, "pre_process"):
        padding = _sequence_part(padding, shard).transpose(0, 1)
    return {"padding_mask": padding}


def _sequence_part(rows: torch.Tensor, shard: tuple[int, int]) -> torch.Tensor:
    """This rank's part ``shard`` of ``rows`` ``[b, s, ...]`` as megatron's scatter along the sequence cuts it,
    sequence-major: ``[s/parts, b, ...]``."""
    return rows.transpose(0, 1).chunk(shard[1])[shard[0]]


def replay_routing(stage: torch.nn.Module, routed_experts: torch.Tensor | None,
                   shard: tuple[int, int] = (0, 1)) -> None:
    """Make the MoE routers of ``stage`` use ``routed_experts`` ``[b, s, layers, k]`` (the engine's choices) in the
    next forward, or choose themselves when it is None (a model built without routing replay has nothing to set).

    Megatron's router sees the stage's hidden states as ``[s * b, H]`` (sequence-major), under sequence parallelism
    only this rank's part ``shard`` (``sequence_shard``) of the positions, ``[s/tp * b, H]``; its replay gathers the
    router's own probabilities at the given experts, so the gradient still reaches the router.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for module in stage.modules():
        replay = getattr(module, "router_replay", None)
        if replay is None:
            continue
        replay.clear_indices()
        if routed_experts is None:
            replay.clear_router_replay_action()
            continue
        layer = routed_experts[:, :, module.layer_number - 1]  # [b, s, k], global layer numbers are 1-based
        mine = _sequence_part(layer, shard)  # [s/parts, b, k]
        replay.set_target_indices(mine.reshape(-1, layer.shape[-1]).long())
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def backward_pass(
    ddp_model,
    ctx: ParallelContext,
    microbatches: Sequence[MicroBatch],
    params: ObjectiveParams,
    global_tokens: int,
    global_seqs: int,
    temperature: float = 1.0,
    impl: str = "auto",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of every micro-batch; grads land in DDP's buffers. Returns the global loss and the
    metric totals (identical on every rank), all device tensors: nothing is read to the host. Collective over all
    ranks."""
    stage = ddp_model.module
    dev = ctx.device  # the closure adds device tensors into these, and they are all-reduced (NCCL: CUDA only)
    sums: dict[str, torch.Tensor] = {k: torch.zeros((), dtype=torch.float64, device=dev) for k in SUMMED_METRICS}
    extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=dev)  # [max raw IS ratio, -min raw IS ratio]
    loss_total = torch.zeros((), dtype=torch.float64, device=dev)
    scale = len(microbatches) * ctx.dp_size

    def closure(mb: MicroBatch, hidden: torch.Tensor):
        nonlocal loss_total
        weight = output_weight(stage)
        mb.check_targets(weight.shape[0] * ctx.tp_size)
        h, f = _selected(mb, hidden)
        # the selected rows all enter the loss (unless none did: the one stand-in row, masked), so they are the valid
        # rows, known without asking the device
        known = mb.loss_rows is not None and mb.loss_rows.numel() > 0
        all_valid = torch.arange(h.shape[0], device=h.device) if known else None
        loss, metrics = fused_linear_grpo_loss(
            h, weight, f["targets"], f["behavior_logp"], f["advantages"], f["loss_mask"], params,
            ref_logp=f.get("ref_logp"), fleet_logp=f["fleet_logp"], seq_ids=f["seq_ids"], temperature=temperature,
            compute_entropy=True, global_token_count=global_tokens, global_seq_count=global_seqs,
            tp_group=ctx.tp_group if ctx.tp_size > 1 else None, impl=impl, valid_rows=all_valid,
        )
        loss_total += loss.detach().double()
        for key in SUMMED_METRICS:
            if key in metrics:
                sums[key] += metrics[key].detach().double()
        if "tis_raw_max" in metrics:  # running extremes on the device: no read per micro-batch
            torch.maximum(extremes[0], metrics["tis_raw_max"].double(), out=extremes[0])
            torch.maximum(extremes[1], -metrics["tis_raw_min"].double(), out=extremes[1])
        return loss * scale, {}

    ddp_model.zero_grad_buffer()
    run_schedule(ddp_model, microbatches, closure, forward_only=False, device=ctx.device,
                 shard=sequence_shard(ddp_model, ctx))
    packed = torch.stack([loss_total] + [sums[k] for k in SUMMED_METRICS])
    # Only the last stage computed them; TP ranks hold identical copies. Sum over PP, then over DP.
    for group in (ctx.pp_group, ctx.dp_group):
        dist.all_reduce(packed, group=group)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    totals = {k: packed[i + 1] for i, k in enumerate(SUMMED_METRICS)}
    totals.update(tis_raw_max=extremes[0], tis_raw_min=-extremes[1])
    return packed[0], totals


def _read_once(loss: torch.Tensor, totals: dict[str, torch.Tensor]) -> tuple[float, dict[str, float]]:
    """The step's loss and finalised metrics as Python floats, in one device-to-host transfer."""
    metrics = loss_parts.finalize_metrics(totals)
    values = torch.stack([loss.double()] + [v.detach().double().reshape(()) for v in metrics.values()]).tolist()
    return values[0], dict(zip(metrics, values[1:]))


def policy_step(ddp_model, optimizer, ctx: ParallelContext, microbatches: Sequence[MicroBatch],
                params: ObjectiveParams, global_tokens: int, global_seqs: int, temperature: float = 1.0,
                impl: str = "auto") -> StepResult:
    """``backward_pass`` then an optimizer step, skipped (grads dropped) when the loss is not finite."""
    optimizer.zero_grad()
    loss, totals = backward_pass(ddp_model, ctx, microbatches, params, global_tokens, global_seqs, temperature, impl)
    loss, metrics = _read_once(loss, totals)
    if not math.isfinite(loss):
        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        return StepResult(loss, {}, float("nan"), skipped=True)
    success, grad_norm, _ = optimizer.step()
    return StepResult(loss, metrics, float(grad_norm or 0.0), skipped=not success)


@torch.no_grad()
def token_logprobs(model, ctx: ParallelContext, microbatches: Sequence[MicroBatch], temperature: float = 1.0,
                   impl: str = "auto", exact: bool = False) -> list[torch.Tensor]:
    """Log-probs ``[b, s]`` of every target under ``model`` (a snapshot, the reference or a teacher), on the last
    stage: at the loss's positions (``MicroBatch.loss_rows``; 0 elsewhere), or at every position of a micro-batch
    without them (the refresh probe).

    Other stages return an empty list. Used for exact behavior log-probs and for the KL reference; ``exact``
    (the refresh probe): the log-softmax in float64, whatever the TP split (``kernels.vocab_parallel_logprobs``).
    """
    out: list[torch.Tensor] = []

    def closure(mb: MicroBatch, hidden: torch.Tensor):
        h, targets = hidden.reshape(-1, hidden.shape[-1]), mb.flat("targets")
        rows = mb.loss_rows  # only the loss's positions are read: the output layer's GEMM over those alone
        if rows is not None:
            h, targets = h.index_select(0, rows), targets.index_select(0, rows)
        logp, _ = vocab_parallel_logprobs(h, output_weight(model), targets, temperature=temperature,
                                          tp_group=ctx.tp_group if ctx.tp_size > 1 else None, impl=impl,
                                          exact=exact)
        if rows is not None:  # 0 elsewhere: nothing reads a position outside the loss
            logp = torch.zeros(mb.targets.numel(), dtype=logp.dtype, device=logp.device).index_copy_(0, rows, logp)
        out.append(logp.reshape(mb.targets.shape).float())
        return hidden.sum() * 0.0, {}

    run_schedule(model, microbatches, closure, forward_only=True, device=ctx.device, shard=sequence_shard(model, ctx))
    return out
