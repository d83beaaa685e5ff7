"""Low-rank adapters beside megatron's parallel linear layers, the base frozen (``lora.*``).

Each targeted linear of a layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) keeps its own
module, name and weights (checkpoints, the HF mapping and the full export see the same base), and gains a child
``lora`` whose ``weight_a`` [r, in] and ``weight_b`` [out, r] add ``scaling * B @ A`` (PEFT's LoRA, ``scaling =
alpha / rank``). The linear's ``forward`` and ``sharded_state_dict`` are replaced on that instance only.

Sharding follows the base weight under tensor parallelism (t ranks), so a merged shard is ``W_local + s B_l A_l``:
- column-parallel (qkv, fc1; output split): A [r, in] on every rank, B [out/t, r] with the rows of the base shard;
- row-parallel (proj, fc2; input split): A [r, in/t] with the columns of the base shard, B [out, r] on every rank.
The one collective each needs rides on the r-wide activation, not the hidden size: column-parallel sums the
partial gradients of ``A x`` (all-reduce, or reduce-scatter after the sequence gather under sequence parallelism);
row-parallel sums the partial products ``A_l x_l`` (all-reduce, or reduce-scatter to this rank's positions).
Under sequence parallelism the replicated factor sees only this rank's positions, so its gradient is marked
``sequence_parallel`` for megatron's finalize step to sum over TP, as it does for the norms.

A is drawn as PEFT draws it (kaiming-uniform, bound 1/sqrt(in)) from a generator seeded by the run's seed and the
layer's global number, then sliced: the same adapter at any TP/PP layout. B starts at zero, so step 0 is the base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import zlib
from typing import Iterator
import torch

COLUMN_PARALLEL: tuple[str, ...] = ("linear_qkv", "linear_fc1")
ROW_PARALLEL: tuple[str, ...] = ("linear_proj", "linear_fc2")
ADAPTER = "lora"
"""The child module's name: adapter parameters are ``<linear>.lora.weight_a`` / ``.weight_b``."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What adapters a model gets (flat: built from ``config.LoraConfig`` by the trainer).

    Attributes:
        rank: r (>= 1). alpha: PEFT's ``lora_alpha``; the update is scaled by alpha / rank.
        dropout: dropout on the adapter's input while training (0: off; PEFT's ``lora_dropout``).
        targets: the linear modules that get an adapter. seed: A's draw (with each layer's global number).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = COLUMN_PARALLEL + ROW_PARALLEL
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraAdapter(torch.nn.Module):
    """The two factors of one linear's adapter, this rank's shards (shapes in the module docstring)."""

    def __init__(self, weight_a: torch.Tensor, weight_b: torch.Tensor, alpha: float, dropout: float,
                 column_parallel: bool):
        super().__init__()
        self.weight_a = torch.nn.Parameter(weight_a)
        self.weight_b = torch.nn.Parameter(weight_b)
        self.rank, self.alpha, self.column_parallel = weight_a.shape[0], alpha, column_parallel
        self.scaling = alpha / self.rank
        self.enabled = True  # off: the base alone (``scored_with``: the KL reference without a copy of the base)
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()


def _draw_a(spec: LoraSpec, layer_number: int, target: str, rank_in: int, tp_size: int, tp_rank: int,
            column: bool, like: torch.Tensor) -> torch.Tensor:
    """This rank's A: the whole [r, in] drawn on the CPU from (seed, layer, target), then sliced for a row-parallel
    layer (its input is split contiguously, as the base weight's columns are)."""
    full_in = rank_in if column else rank_in * tp_size
    generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + layer_number * 101 + zlib.crc32(target.encode()))
    bound = full_in ** -0.5  # kaiming_uniform_(a=sqrt(5)), PEFT's and nn.Linear's default
    full = (torch.rand(spec.rank, full_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
    local = full if column else full[:, tp_rank * rank_in:(tp_rank + 1) * rank_in]
    return local.to(device=like.device, dtype=like.dtype).contiguous()


def _mark(param: torch.nn.Parameter, split_dim: int | None, sequence_parallel: bool) -> None:
    """Megatron's parameter attributes: a split factor is tensor-parallel (grad norm counts every rank's shard); a
    replicated one is counted once, and summed over TP by finalize_model_grads under sequence parallelism."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    if split_dim is not None:
        set_tensor_model_parallel_attributes(param, True, split_dim, 1)
    else:
        param.sequence_parallel = sequence_parallel


def _column_delta(adapter: LoraAdapter, x: torch.Tensor, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """s B_l A x for a column-parallel layer: x [s, b, in] ([s/t, b, in] under sequence parallelism)."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    h = adapter.dropout(x) @ adapter.weight_a.t()  # [s(/t), b, r]
    if sequence_parallel:  # backward: reduce-scatter of every rank's B_l^T g_l
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=tp_group)
    elif tp_group is not None and tp_group.size() > 1:  # backward: all-reduce of the partial B_l^T g_l
        h = copy_to_tensor_model_parallel_region(h, group=tp_group)
    return (h @ adapter.weight_b.t()) * adapter.scaling


def _row_delta(adapter: LoraAdapter, x: torch.Tensor, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """s B A_l x_l for a row-parallel layer: x [s, b, in/t]; the result is laid out as the layer's output ([s/t, b,
    out] under sequence parallelism)."""
    from megatron.core.tensor_parallel import (reduce_from_tensor_model_parallel_region,
                                               reduce_scatter_to_sequence_parallel_region)

    h = adapter.dropout(x) @ adapter.weight_a.t()  # [s, b, r], this rank's part of the sum over the input
    if sequence_parallel:
        h = reduce_scatter_to_sequence_parallel_region(h, group=tp_group)
    elif tp_group is not None and tp_group.size() > 1:
        h = reduce_from_tensor_model_parallel_region(h, group=tp_group)
    return (h @ adapter.weight_b.t()) * adapter.scaling


def _adapted_forward(module: torch.nn.Module, base_forward, x: torch.Tensor, *args, **kwargs):
    adapter: LoraAdapter = getattr(module, ADAPTER)
    result = base_forward(x, *args, **kwargs)
    # TE's fused norm + linear with return_layernorm_output also returns the norm's output, which A reads: (out, bias,
    # normed) when TE returns the bias, else megatron's (out, None) holds (out, normed) as its first item
    if len(result) == 3:
        out, bias, x = result
    else:
        out, bias = result
        if isinstance(out, tuple):
            out, x = out
    if not adapter.enabled:
        return out, bias
    sequence_parallel = bool(getattr(module, "sequence_parallel", False))
    tp_group = getattr(module, "tp_group", None)
    delta = (_column_delta if adapter.column_parallel else _row_delta)(adapter, x, sequence_parallel, tp_group)
    return out + delta.to(out.dtype), bias


def _adapted_sharded_state_dict(module: torch.nn.Module, base_method, prefix: str = "", sharded_offsets=(),
                                metadata=None, gated: bool = False):
    """The base layer's entries, and the adapter's with its own split axis (the base method would call them
    replicated). ``gated`` (a SwiGLU fc1): B's rows on a rank are its ``[gate_r; up_r]``, as the base weight's, so B
    is stored as megatron's MLP stores that weight (gate and up halves each split over TP); a plain row split would
    store ``[gate_0; up_0; gate_1; ...]`` and another TP size would read gate rows as up rows."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    entries = base_method(prefix, sharded_offsets, metadata)
    adapter: LoraAdapter = getattr(module, ADAPTER)
    axis = {"weight_b": 0} if adapter.column_parallel else {"weight_a": 1}
    entries.update(make_sharded_tensors_for_checkpoint(
        {"weight_a": adapter.weight_a, "weight_b": adapter.weight_b}, f"{prefix}{ADAPTER}.", axis, sharded_offsets,
        tp_group=getattr(module, "tp_group", None), dp_cp_group=(metadata or {}).get("dp_cp_group")))
    if gated:
        key = f"{prefix}{ADAPTER}.weight_b"
        entries[key] = apply_swiglu_sharded_factory(entries[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
    return entries


def _attach(module: torch.nn.Module, spec: LoraSpec, target: str, layer_number: int) -> None:
    """Give one linear its adapter (this rank's shards) and route its forward and checkpoint entries through it."""
    from megatron.core import parallel_state

    column = target in COLUMN_PARALLEL
    weight = module.weight
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out_local, in_local = weight.shape
    weight_a = _draw_a(spec, layer_number, target, in_local, tp_size, tp_rank, column, weight)
    weight_b = torch.zeros(out_local, spec.rank, dtype=weight.dtype, device=weight.device)
    adapter = LoraAdapter(weight_a, weight_b, spec.alpha, spec.dropout, column)
    sequence_parallel = bool(getattr(module, "sequence_parallel", False))
    _mark(adapter.weight_a, None if column else 1, sequence_parallel)
    _mark(adapter.weight_b, 0 if column else None, sequence_parallel)
    module.add_module(ADAPTER, adapter)
    if hasattr(module, "return_layernorm_output"):  # TE's LayerNormColumnParallelLinear: A reads the norm's output
        module.return_layernorm_output = True
    module.forward = functools.partial(_adapted_forward, module, module.forward)
    gated = target == "linear_fc1" and bool(getattr(module.config, "gated_linear_unit", False))
    module.sharded_state_dict = functools.partial(_adapted_sharded_state_dict, module, module.sharded_state_dict,
                                                  gated=gated)


def attach_lora(model: torch.nn.Module, spec: LoraSpec) -> list[str]:
    """Freeze every parameter of ``model`` (one pipeline stage) and add an adapter to each targeted linear of its
    layers; returns the adapted modules' names. Collective-free; every TP rank of a stage draws the same A.

    Raises:
        ValueError: a target that this model's layers lack (an MoE layer's experts have no ``linear_fc1`` of their
            own: the refusal comes earlier, from the config).
    """
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for index, layer in enumerate(model.decoder.layers):
        for target in spec.targets:
            parent = layer.self_attention if target in ("linear_qkv", "linear_proj") else layer.mlp
            module = getattr(parent, target, None)
            if module is None or not hasattr(module, "weight"):
                raise ValueError(f"lora.targets: layer {layer.layer_number} has no dense {target} to adapt")
            _attach(module, spec, target, layer.layer_number)
            adapted.append(f"decoder.layers.{index}.{'self_attention' if parent is layer.self_attention else 'mlp'}"
                           f".{target}")
    return adapted


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters' parameters by name (``...<linear>.lora.weight_a``); empty without LoRA."""
    return {name: param for name, param in model.named_parameters() if f".{ADAPTER}.weight_" in name}


@contextlib.contextmanager
def scored_with(model: torch.nn.Module, values: dict[str, torch.Tensor] | None) -> Iterator[torch.nn.Module]:
    """``model`` with other adapter values for a forward without gradients: ``values`` (a copy of
    ``adapter_parameters`` taken earlier: the version the engine serves) or, with None, no adapters (the base: the
    initial policy). What a frozen copy of the whole stage gave, for the size of the adapters."""
    params = adapter_parameters(model)
    adapters = [m for m in model.modules() if isinstance(m, LoraAdapter)]
    kept = {name: param.data for name, param in params.items()}
    try:
        if values is None:
            for adapter in adapters:
                adapter.enabled = False
        else:
            for name, param in params.items():
                param.data = values[name]
        yield model
    finally:
        for adapter in adapters:
            adapter.enabled = True
        for name, param in params.items():
            param.data = kept[name]


def lora_spec(arch, rank: int, alpha: float, dropout: float, targets: list[str] | None, seed: int) -> LoraSpec | None:
    """The adapters of ``arch`` for the ``lora.*`` values; None when rank is 0 (full fine-tuning).

    Raises:
        ValueError: an MLP target on a mixture-of-experts arch (one line, saying why).
    """
    if rank <= 0:
        return None
    mlp = ("linear_fc1", "linear_fc2")
    if targets is None:
        targets = [t for t in COLUMN_PARALLEL + ROW_PARALLEL if not (arch.is_moe and t in mlp)]
    order = COLUMN_PARALLEL + ROW_PARALLEL
    if unknown := [t for t in targets if t not in order]:
        raise ValueError(f"lora.targets: unknown {unknown}; valid: {list(order)}")
    if arch.is_moe and any(t in mlp for t in targets):
        raise ValueError(f"lora.targets={list(targets)}: a Qwen3-MoE layer's MLP is its experts, and adapters on "
                         "experts (split over expert and expert-tensor parallelism) are not supported; adapt the "
                         "attention: lora.targets=[linear_qkv,linear_proj]")
    return LoraSpec(rank, alpha, dropout, tuple(sorted(targets, key=order.index)), seed)
