"""Weights of a live megatron model stage: load from HF tensors, and stream out as HF buckets.

The streaming export is what every fleet refresh uses: parameters are TP-gathered one at a time onto TP rank 0 of
each pipeline stage, converted to HF names, and yielded in buckets of about ``bucket_bytes``; no rank ever holds
the whole model, and each PP stage exports its own layers (with global layer indices).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from checkpoint_tools import _mapping as M
from megatron_offgrpo.model import QwenArch

Named = list[tuple[str, torch.Tensor]]


def _stage_params(
    model: torch.nn.Module, arch: QwenArch, pp: int, pp_rank: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """(local-spec megatron name, parameter) of a stage in the weight map's canonical order (the order of
    ``hf_names``), so exported tensors arrive in the order a streaming writer declared; unknown names raise."""
    params = {M.local_name(name): param for name, param in model.named_parameters()}
    ordered = [(name, params.pop(name)) for name in M.full_megatron_names(arch, pp, pp_rank) if name in params]
    if params:
        raise M.UnknownTensorError(f"model parameters outside the weight map's layout: {sorted(params)[:5]}")
    return ordered


@torch.no_grad()
def load_hf_into_stage(
    model: torch.nn.Module, arch: QwenArch, hf_tensors: Mapping[str, torch.Tensor], tp: int, tp_rank: int, pp: int,
    pp_rank: int,
) -> None:
    """Copy this rank's shard of every parameter of a model stage from HF tensors.

    Raises:
        KeyError: naming a HF tensor the stage needs that ``hf_tensors`` lacks.
        UnknownTensorError: naming a model parameter the weight map does not know.
        ValueError: naming a parameter whose shard shape differs from the model's.
    """
    offset = M.layers_of_stage(arch, pp, pp_rank).start
    for name, param in _stage_params(model, arch, pp, pp_rank):
        full = M.hf_to_megatron(name, arch, hf_tensors, layer_offset=offset)
        shard = M.shard_for_tp(full, M.split_kind(name), tp, tp_rank)
        if shard.shape != param.shape:
            raise ValueError(f"parameter {name}: shard shape {tuple(shard.shape)} != model shape {tuple(param.shape)}")
        param.copy_(shard)


def _gather_full(param: torch.Tensor, kind: str, tp_group, tp_size: int, tp_rank: int) -> torch.Tensor | None:
    """The TP-merged tensor on TP rank 0 (None elsewhere); replicated tensors need no communication."""
    if tp_size == 1 or kind == "replicated":
        return param.detach() if tp_rank == 0 else None
    data = param.detach().contiguous()
    shards = [torch.empty_like(data) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(data, gather_list=shards, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
    return M.merge_tp(shards, kind) if tp_rank == 0 else None


@torch.no_grad()
def stream_hf_buckets(
    model: torch.nn.Module,
    arch: QwenArch,
    pp: int = 1,
    pp_rank: int = 0,
    tp_group=None,
    bucket_bytes: int = 256 * 1024**2,
    dtype: torch.dtype | None = None,
) -> Iterator[Named]:
    """Yield lists of HF ``(name, tensor)`` of about ``bucket_bytes`` from a live model stage.

    Every rank of the stage's TP group must iterate (the gathers are collective); buckets are yielded only on TP
    rank 0. With tied embeddings the last stage's copy of the output layer is skipped (the embedding carries it).

    Args:
        model: one PP stage (unwrapped from DDP). arch: its architecture. pp, pp_rank: the pipeline layout.
        tp_group: the TP process group (None: no TP). bucket_bytes: bucket size bound.
        dtype: cast exported tensors (e.g. bf16 for a bf16 fleet); None keeps the parameters' dtype.
    """
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    offset = M.layers_of_stage(arch, pp, pp_rank).start

    def per_parameter() -> Iterator[Named]:
        for name, param in _stage_params(model, arch, pp, pp_rank):
            full = _gather_full(param, M.split_kind(name), tp_group, tp_size, tp_rank)
            if full is not None:
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
