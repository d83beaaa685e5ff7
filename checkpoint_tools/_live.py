"""Weights of a megatron model stage: load from HF tensors, stream out as HF buckets, and the same for state dicts.

The streaming export is what every fleet refresh uses: parameters are TP-gathered one at a time onto TP rank 0 of
each pipeline stage, converted to HF names, and yielded in buckets of about ``bucket_bytes``; no rank ever holds
the whole model, and each PP stage exports its own layers (with global layer indices). MoE experts are exported a
layer's stack at a time: TP-gathered over the expert-TP group, then over the EP group onto EP rank 0.

A model's parameters and state-dict keys are spelled by its layer spec: the local spec's or Transformer Engine's
(norms fused into ``linear_qkv`` / ``linear_fc1`` as ``layer_norm_weight``, grouped experts ``linear_fc1.weight{j}``);
everything here accepts both (``_mapping``). A state dict also holds ``_extra_state`` entries, which are not weights:
TE modules' FP8 metadata (TE's ``get_extra_state``: an empty uint8 tensor without FP8) and ``None`` from megatron's own
parallel linears (``tensor_parallel/layers.py`` ``get_extra_state``, "Keep compatibility with TE state dict").
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist

from checkpoint_tools import _adapter as A
from checkpoint_tools import _mapping as M
from megatron_offgrpo.model import QwenArch

Named = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
EXTRA_STATE = "_extra_state"  # torch's key suffix for a module's get_extra_state (nn.modules.module)


def is_extra_state(key: str) -> bool:
    """A state-dict key holding a module's extra state (FP8 metadata or megatron's placeholder), not a weight."""
    return key.rsplit(".", 1)[-1] == EXTRA_STATE


def _by_canonical_name(named: Iterable[tuple[str, T]], arch: QwenArch, pp: int, pp_rank: int
                       ) -> list[tuple[str, list[T]]]:
    """Group a stage's (model name, item) pairs by local-spec megatron name, in the weight map's canonical order (the
    order of ``hf_names``), so exported tensors arrive in the order a streaming writer declared.

    One item per name, except a layer's expert stack: this rank's experts, in local expert order. ``_extra_state``
    keys are skipped (nothing of HF's comes from them); any other name the map does not know raises, and so does a
    tensor given in both spellings (local and TE).
    """
    items: dict[str, list] = {}
    experts: dict[str, dict[int, T]] = {}
    seen: dict[tuple[str, int], str] = {}  # what each name stands for: one tensor, or one expert of a stack
    for name, item in named:
        if is_extra_state(name):
            continue
        stacked = M.expert_param(name) or (M.local_name(name), -1)
        if stacked in seen:  # both spellings of one tensor: which one is meant cannot be told
            raise ValueError(f"{seen[stacked]!r} and {name!r} are the same megatron tensor in two spellings")
        seen[stacked] = name
        if stacked[1] < 0:
            items[stacked[0]] = [item]
        else:
            experts.setdefault(stacked[0], {})[stacked[1]] = item
    items.update({name: [by_index[j] for j in sorted(by_index)] for name, by_index in experts.items()})
    ordered = [(name, items.pop(name)) for name in M.full_megatron_names(arch, pp, pp_rank) if name in items]
    if items:
        raise M.UnknownTensorError(f"model parameters outside the weight map's layout: {sorted(items)[:5]}")
    return ordered


def _stage_params(
    model: torch.nn.Module, arch: QwenArch, pp: int, pp_rank: int
) -> list[tuple[str, list[torch.nn.Parameter]]]:
    """(local-spec megatron name, its parameters) of a stage, canonical order (``_by_canonical_name``); adapter
    factors are not among them (``_stage_adapters``)."""
    return _by_canonical_name(((n, p) for n, p in model.named_parameters() if not A.is_adapter(n)), arch, pp,
                              pp_rank)


def _stage_adapters(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The adapted base weights of a stage (local-spec megatron name, stage-local layer) -> their adapter module
    (``weight_a``, ``weight_b``, ``scaling``).

    Raises:
        UnknownTensorError: naming an adapter parameter on a linear that cannot carry one.
    """
    adapters = {}
    for name, _ in model.named_parameters():
        if A.is_adapter(name):
            base, _, _ = A.parse_adapter(name)
            adapters[base] = model.get_submodule(name.rsplit(".", 1)[0])
    return adapters


def _hf_shards(
    grouped: list[tuple[str, list[T]]], arch: QwenArch, hf_tensors: Mapping[str, torch.Tensor], tp: int,
    tp_rank: int, pp: int, pp_rank: int, ep: int, ep_rank: int, etp: int | None, etp_rank: int | None,
) -> Iterator[tuple[str, list[T], list[torch.Tensor]]]:
    """For each grouped name: its items and this rank's shards of it from HF tensors, one per item (an expert stack:
    one per local expert)."""
    offset = M.layers_of_stage(arch, pp, pp_rank).start
    experts = M.experts_of_rank(arch, ep, ep_rank) if arch.is_moe else None
    for name, items in grouped:
        full = M.hf_to_megatron(name, arch, hf_tensors, layer_offset=offset, experts=experts)
        expert = M.is_expert_kind(M.split_kind(name))
        split, rank = (etp or tp, tp_rank if etp_rank is None else etp_rank) if expert else (tp, tp_rank)
        shard = M.shard_for_tp(full, M.split_kind(name), split, rank)
        pieces = list(shard.unbind(0)) if expert else [shard]
        if len(pieces) != len(items):
            raise ValueError(f"parameter {name}: {len(items)} local experts in the model, {len(pieces)} expected")
        yield name, items, pieces


@torch.no_grad()
def load_hf_into_stage(
    model: torch.nn.Module, arch: QwenArch, hf_tensors: Mapping[str, torch.Tensor], tp: int, tp_rank: int, pp: int,
    pp_rank: int, ep: int = 1, ep_rank: int = 0, etp: int | None = None, etp_rank: int | None = None,
) -> None:
    """Copy this rank's shard of every parameter of a model stage from HF tensors (an EP rank reads only its
    experts; ``etp``/``etp_rank``: how the experts are tensor-split, default as the rest, ``tp``/``tp_rank``).

    Raises:
        KeyError: naming a HF tensor the stage needs that ``hf_tensors`` lacks.
        UnknownTensorError: naming a model parameter the weight map does not know.
        ValueError: naming a parameter whose shard shape differs from the model's.
    """
    grouped = _stage_params(model, arch, pp, pp_rank)
    for name, params, pieces in _hf_shards(grouped, arch, hf_tensors, tp, tp_rank, pp, pp_rank, ep, ep_rank, etp,
                                           etp_rank):
        for piece, param in zip(pieces, params):
            if piece.shape != param.shape:
                raise ValueError(f"parameter {name}: shard shape {tuple(piece.shape)} != model shape "
                                 f"{tuple(param.shape)}")
            param.copy_(piece)


def _gather(data: torch.Tensor, group) -> list[torch.Tensor] | None:
    """Every rank's ``data`` on the group's rank 0 (in rank order), None elsewhere; a group of one: no call."""
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return [data]
    rank = dist.get_rank(group)
    data = data.contiguous()  # gloo sends wrong bytes from views
    shards = [torch.empty_like(data) for _ in range(size)] if rank == 0 else None
    dist.gather(data, gather_list=shards, dst=dist.get_global_rank(group, 0), group=group)
    return shards


def _gather_full(params: list[torch.Tensor], kind: str, tp_group, expert_tp_group, ep_group) -> torch.Tensor | None:
    """The full tensor on the rank that exports (TP rank 0, and for experts EP rank 0 too), None elsewhere.

    Replicated tensors need no communication. An expert stack is TP-merged over the expert-TP group, then its EP
    ranks' stacks are concatenated in rank order (EP rank r holds experts r*E/ep ..).
    """
    if not M.is_expert_kind(kind):
        shards = [params[0].detach()] if kind == "replicated" else _gather(params[0].detach(), tp_group)
        if tp_group is not None and dist.get_rank(tp_group) != 0:
            return None
        return M.merge_tp(shards, kind)
    tp_shards = _gather(torch.stack([p.detach() for p in params]), expert_tp_group)
    if tp_shards is None:
        return None
    ep_stacks = _gather(M.merge_tp(tp_shards, kind), ep_group)
    return None if ep_stacks is None else torch.cat(ep_stacks)


def _adapter_pairs(base: str, adapter: torch.nn.Module, arch: QwenArch, offset: int, tp_group, exporter: bool,
                   dtype: torch.dtype | None) -> Named:
    """The PEFT pairs of one adapted linear on the exporting rank (empty elsewhere): each factor TP-gathered as it is
    split (``adapter_split``), then named as PEFT names it (``adapter_to_peft``)."""
    pairs: Named = []
    for factor in ("a", "b"):
        name = f"{base.removesuffix('.weight')}.{A.ADAPTER}.weight_{factor}"
        full = _gather_full([getattr(adapter, f"weight_{factor}")], A.adapter_split(name), tp_group, None, None)
        if full is not None and exporter:
            pairs += [(peft_name, (t.to(dtype) if dtype is not None else t).contiguous())
                      for peft_name, t in A.adapter_to_peft(name, full, arch, layer_offset=offset)]
    return pairs


@torch.no_grad()
def stream_hf_buckets(
    model: torch.nn.Module,
    arch: QwenArch,
    pp: int = 1,
    pp_rank: int = 0,
    tp_group=None,
    bucket_bytes: int = 256 * 1024**2,
    dtype: torch.dtype | None = None,
    ep_group=None,
    expert_tp_group=None,
    dense: bool = True,
    experts: bool = True,
    adapter: A.AdapterExport = "merge",
) -> Iterator[Named]:
    """Yield lists of HF ``(name, tensor)`` of about ``bucket_bytes`` from a live model stage.

    Every rank of the stage's TP group (and, for MoE, of its EP and expert-TP groups) must iterate (the gathers are
    collective); buckets are yielded only on TP rank 0 of EP rank 0. With tied embeddings the last stage's copy of
    the output layer is skipped (the embedding carries it).

    Args:
        model: one PP stage (unwrapped from DDP). arch: its architecture. pp, pp_rank: the pipeline layout.
        tp_group: the TP process group (None: no TP). bucket_bytes: bucket size bound.
        dtype: cast exported tensors (e.g. bf16 for a bf16 fleet); None keeps the parameters' dtype.
        ep_group, expert_tp_group: the MoE expert-parallel and expert-TP groups (None: not split).
        dense, experts: which parameters this rank takes part in. A replica skips them: a rank of a data-parallel
            replica its dense ones, a rank of an expert-data-parallel replica its experts. The two differ when the
            experts are replicated inside a TP group (etp < tp without EP to match: tp=2, etp=1, ep=1), where the TP
            ranks gather the dense weights together but each holds whole copies of the experts.
        adapter: "merge": the HF weights, each adapted one ``W + s B A`` (merged shard by shard in fp32, rounded
            once to ``dtype``); "only": the adapters alone, PEFT-named. Their megatron names never leave.

    Raises:
        ValueError: ``adapter="only"`` on a model without adapters.
    """
    offset = M.layers_of_stage(arch, pp, pp_rank).start
    exporter = all(group is None or dist.get_rank(group) == 0 for group in (tp_group, ep_group))
    adapters, grouped = _stage_adapters(model), _stage_params(model, arch, pp, pp_rank)
    if adapter == "only" and not adapters:  # every stage holds layers, so every stage of a LoRA model has adapters
        raise ValueError("adapter export: the model has no LoRA adapters (lora.rank=0 or a checkpoint without LoRA)")
    if stray := sorted(set(adapters) - {name for name, _ in grouped}):  # never dropped silently
        raise M.UnknownTensorError(f"adapters on {stray[:3]}: not weights of this {arch.hf_architecture} model")

    def per_parameter() -> Iterator[Named]:
        for name, params in grouped:
            if not (experts if M.is_expert_kind(M.split_kind(name)) else dense):
                continue
            lora = adapters.get(name)
            if adapter == "only":
                if lora is not None:
                    yield _adapter_pairs(name, lora, arch, offset, tp_group, exporter, dtype)
                continue
            if lora is not None:  # merged on every TP rank's shard before the gather: one shard-sized product each
                params = [A.merge_shard(params[0], lora.weight_a, lora.weight_b, lora.scaling, dtype)]
            full = _gather_full(params, M.split_kind(name), tp_group, expert_tp_group, ep_group)
            if full is not None and exporter:
                yield [(hf_name, (tensor.to(dtype) if dtype is not None else tensor).contiguous())
                       for hf_name, tensor in M.megatron_to_hf(name, full, arch, layer_offset=offset)]

    yield from rebucket(per_parameter(), bucket_bytes)


def rebucket(weights: Iterable[Named], bucket_bytes: int) -> Iterator[Named]:
    """Regroup a stream of lists of HF ``(name, tensor)`` into buckets of at least ``bucket_bytes`` (0: one tensor
    per bucket); the one bucketing loop of the export and of both fleet transports.

    A bucket is emitted as soon as it reaches ``bucket_bytes``, so memory stays at about one bucket plus one
    tensor; the last bucket may be smaller.
    """
    bucket: Named = []
    size = 0
    for incoming in weights:
        for name, tensor in incoming:
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
    if bucket:
        yield bucket
