"""The trainer's weights as HF buckets on global rank 0, for the engine refresh and the HF exports (v0, the
periodic and final exports of a run, the warm-up's result), and the description its checkpoints carry.

Every pipeline stage streams its own layers (``checkpoint_tools.stream_hf_buckets``: TP-gathered one parameter at a
time onto the stage's TP rank 0); stages other than the first send their buckets to global rank 0 point to point,
one bucket at a time (metadata, then one flat contiguous buffer). Only the first DP replica exports; with expert
parallelism its EP group (DP ranks that hold the other experts) joins the expert gathers. A LoRA policy exports
merged (``W + s B A``: the HF exports, a merged refresh) or its adapter alone, PEFT-named (an adapter refresh,
``RUN/adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from checkpoint_tools import adapters, dist_ckpt, stream_hf_buckets, write_hf
from megatron_offgrpo.data import ASSETS
from megatron_offgrpo.model import QwenArch, hf_config_dict
from megatron_offgrpo.runlog import writing
from megatron_offgrpo.runtime import ParallelContext

Bucket = list[tuple[str, torch.Tensor]]


def _send_bucket(bucket: Bucket | None, dst: int) -> None:
    meta = None if bucket is None else [(n, tuple(t.shape), t.dtype) for n, t in bucket]
    dist.send_object_list([meta], dst=dst)
    if bucket:
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket])  # contiguous: gloo sends raw bytes
        dist.send(flat, dst=dst)


def _recv_buckets(src: int) -> Iterator[Bucket]:
    while True:
        box: list = [None]
        dist.recv_object_list(box, src=src)
        meta = box[0]
        if meta is None:
            return
        sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in meta]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.recv(flat, src=src)
        out, offset = [], 0
        for (name, shape, dtype), size in zip(meta, sizes):
            out.append((name, flat[offset:offset + size].view(dtype).reshape(shape)))
            offset += size
        yield out


def export_buckets(model, arch: QwenArch, ctx: ParallelContext, bucket_bytes: int = 256 * 1024**2,
                   dtype: torch.dtype | None = None, adapter: adapters.AdapterExport = "merge") -> Iterator[Bucket]:
    """Yield every HF bucket of the model on global rank 0; every other rank must iterate too (collective).

    Args:
        model: this rank's stage (unwrapped). arch: its architecture. ctx: the parallel layout.
        bucket_bytes: bucket size bound. dtype: cast exported tensors (None: keep the parameters' dtype).
        adapter: a LoRA model's export (``stream_hf_buckets``): "merge" (HF weights, adapters merged in) or "only"
            (the adapters alone, PEFT names).
    """
    # The first DP replica exports the dense weights, the first expert-DP replica the experts (different ranks when
    # experts are replicated inside a TP group: tp=2, etp=1, ep=1); a rank of neither has nothing to send.
    dense, experts = ctx.dp_rank == 0, ctx.expert_dp_rank == 0
    if not (dense or experts):
        return
    tp_group = ctx.tp_group if ctx.tp_size > 1 else None
    ep_groups = (ctx.ep_group, ctx.expert_tp_group) if arch.is_moe else (None, None)
    local = stream_hf_buckets(model, arch, ctx.pp_size, ctx.pp_rank, tp_group, bucket_bytes, dtype, *ep_groups,
                              dense=dense, experts=experts, adapter=adapter)
    exporter = ctx.tp_rank == 0 and ctx.dp_rank == 0
    if ctx.pp_rank == 0:
        for bucket in local:
            if exporter:
                yield bucket
        if exporter:
            for stage in range(1, ctx.pp_size):
                yield from _recv_buckets(dist.get_global_rank(ctx.pp_group, stage))
        return
    root = dist.get_global_rank(ctx.pp_group, 0)
    for bucket in local:
        if exporter:
            _send_bucket(bucket, root)
    if exporter:
        _send_bucket(None, root)


def source_hf_config(arch: QwenArch, source_dir: Path) -> dict:
    """The HF config of an export: the arch over ``source_dir``'s config (token ids and other fields it lacks)."""
    source_config = (json.loads((source_dir / "config.json").read_text()) if (source_dir / "config.json").exists()
                     else {})
    return hf_config_dict(arch, source_config)


def hf_extra_dirs(source_dir: Path) -> list[Path]:
    """Where an export's generation config and tokenizer come from, in copy order: ``source_dir`` (the run's
    ``model.hf_path``), then the bundled Qwen tokenizer when that directory has none."""
    has_tokenizer = (source_dir / "tokenizer_config.json").exists()
    return [source_dir] if has_tokenizer else [source_dir, ASSETS / "qwen2-tokenizer"]


def model_card(model, arch: QwenArch, ctx: ParallelContext, source_dir: Path) -> dist_ckpt.DistModelCard:
    """What a checkpoint of this run needs to be exported without the recipe (``checkpoint_tools``' format)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return dist_ckpt.DistModelCard(source_hf_config(arch, source_dir), dtype, ctx.layout(),
                                   adapters.card_of_model(model))


def export_hf_dir(model, arch: QwenArch, ctx: ParallelContext, out: Path, source_dir: Path) -> Path | None:
    """Write the model as a loadable HF directory (atomic) from global rank 0; collective. Returns it on rank 0.

    ``source_dir`` (the run's ``model.hf_path``) provides the config fields the arch does not hold (token ids,
    ...), the generation config and the tokenizer (``hf_extra_dirs``). An existing ``out`` is replaced only once
    the new directory is complete.
    """
    buckets = export_buckets(model, arch, ctx)
    if ctx.rank != 0:
        for _ in buckets:
            pass
        return None
    dtype = next(model.parameters()).dtype
    pairs = (pair for bucket in buckets for pair in bucket)
    with writing(out):  # a full disk: the error names the export (its temporary sibling is removed)
        return write_hf(out, arch, source_hf_config(arch, source_dir), pairs, lambda _: dtype,
                        hf_extra_dirs(source_dir), overwrite=True)


def export_adapter_dir(model, arch: QwenArch, ctx: ParallelContext, out: Path, base_model: str | None
                       ) -> Path | None:
    """Write the policy's LoRA adapter as a PEFT directory (atomic) from global rank 0; collective. Returns it on
    rank 0. ``base_model`` (the run's ``model.hf_path``) is written as its ``base_model_name_or_path``.

    Raises:
        ValueError: the policy has no adapter.
    """
    card = adapters.card_of_model(model)
    if card is None:  # on every rank alike, before any collective
        raise ValueError("export_adapter_dir: the policy has no LoRA adapter (lora.rank=0)")
    buckets = export_buckets(model, arch, ctx, adapter="only")
    if ctx.rank != 0:
        for _ in buckets:
            pass
        return None
    pairs = (pair for bucket in buckets for pair in bucket)
    with writing(out):
        return adapters.write_peft(out, card, arch, pairs, base_model, overwrite=True)
