"""How a MoE policy's routers spread one optimizer step's tokens over the experts: the step's router metrics.

Counted by forward hooks on this rank's routers (megatron's ``TopKRouter`` returns the routing map ``[tokens, E]``)
only while ``counting()`` is open, so probes and evaluation forwards of the same model do not count. Pad positions
are routed like tokens (their outputs are never used) but not counted: the step hands megatron each micro-batch's
``padding_mask``, which keeps them out of its load-balancing loss too. The load-balancing loss is read from
megatron's own per-layer tracker, then cleared. Under sequence parallelism each TP rank routes its own part of every
row, and its tracked loss is that part's share (megatron normalises by the tokens of all TP ranks): both are summed
over TP then, where without it one TP rank counts.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_offgrpo.runtime import ParallelContext


class RouterLoad:
    """Tokens per expert of every MoE layer of one stage, over the forwards inside ``counting()``."""

    def __init__(self, model: torch.nn.Module, num_layers: int, num_experts: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self._counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._active = False
        self._tp_split = bool(model.config.sequence_parallel)  # TP ranks route different positions
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(self._hook(module.layer_number - 1))  # global, 1-based in megatron

    def _hook(self, layer: int):
        def count(module, inputs, output) -> None:
            if self._active:
                routing_map = output[1]  # [positions, E], sequence-major as the router's padding mask [s, b]
                if len(inputs) > 1 and inputs[1] is not None:
                    routing_map = routing_map[~inputs[1].reshape(-1)]
                self._counts[layer] += routing_map.sum(dim=0).to(device="cpu", dtype=torch.float64)

        return count

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the routing of the forwards run inside (one optimizer step's schedule)."""
        self._counts.zero_()
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def metrics(self, ctx: ParallelContext, microbatches: int) -> dict[str, float | list[float]]:
        """The step's router metrics, identical on every rank (collective):

        ``moe_load_max`` / ``moe_load_min``: the most / least loaded expert's tokens over the mean, in the worst
        layer (1.0 = balanced); ``moe_tokens_per_expert``: tokens each expert received, summed over layers;
        ``moe_aux_loss``: megatron's load-balancing loss (before its coefficient), mean over layers and micro-batches,
        when it is on. ``microbatches``: this rank's micro-batches in the step.
        """
        # DP ranks route their own tokens (and TP ranks under sequence parallelism); PP stages hold their own layers
        counts = _summed(self._counts, ctx, self._tp_split)
        per_layer_mean = counts.mean(dim=1, keepdim=True).clamp_min(1e-9)
        load = counts / per_layer_mean
        out: dict[str, float | list[float]] = {
            "moe_load_max": float(load.max()), "moe_load_min": float(load.min()),
            "moe_tokens_per_expert": counts.sum(dim=0).tolist(),
        }
        aux = _take_aux_loss(ctx, counts.shape[0], microbatches, self._tp_split)
        if aux is not None:
            out["moe_aux_loss"] = aux
        return out


def _summed(local: torch.Tensor, ctx: ParallelContext, tp_split: bool) -> torch.Tensor:
    """``local`` summed over the ranks that hold different tokens or layers (one TP rank of each, as TP ranks see the
    same tokens, unless ``tp_split``: sequence parallelism), as fp64 on the CPU; reduced on ``ctx.device`` (NCCL
    reduces only CUDA tensors)."""
    values = local.to(ctx.device) if tp_split or ctx.tp_rank == 0 else torch.zeros_like(local, device=ctx.device)
    if dist.is_initialized() and ctx.world_size > 1:
        dist.all_reduce(values)
    return values.to("cpu", torch.float64)


def _take_aux_loss(ctx: ParallelContext, num_layers: int, microbatches: int, tp_split: bool) -> float | None:
    """Mean over layers and micro-batches (of every DP rank) of megatron's tracked load-balancing loss; None when
    it is off. The tracker is cleared for the next step."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
    values = (entry["values"].detach().to("cpu", torch.float64) if entry is not None
              else torch.zeros(num_layers, dtype=torch.float64))
    clear_aux_losses_tracker()
    # per layer, the sum over this rank's micro-batches; then the present flag and the micro-batch count, counted
    # once per DP rank (its first stage, TP rank 0)
    first_stage = float(ctx.pp_rank == 0 and ctx.tp_rank == 0)
    packed = _summed(torch.cat([values, torch.tensor([float(entry is not None), microbatches * first_stage],
                                                     dtype=torch.float64)]), ctx, tp_split)
    if not packed[-2].item():
        return None
    return float(packed[:-2].sum() / (num_layers * max(packed[-1].item(), 1.0)))
