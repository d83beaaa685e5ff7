"""HF -> megatron ``dist_checkpointing``: the one megatron format, the trainer's own, written by ``hf-to-megatron``.

Layout of ``OUT`` (Megatron-LM's, as its own HF converters write one):
    latest_checkpointed_iteration.txt   "release"
    release/                            megatron dist_checkpointing files (torch_dist: ``metadata.json``,
                                        ``common.pt``, ``*.distcp``) holding the model under the sharded keys the
                                        trainer saves (``decoder.layers.self_attention.linear_qkv.weight``, ...);
                                        ``offgrpo_model.json`` and ``hf_extra/``, the card the trainer writes too;
                                        in ``common.pt`` what Megatron-LM's loader reads first (``args`` with the
                                        saved TP/PP, ``checkpoint_version`` 3.0, ``iteration`` 0)

Loading reshards, so the layout a checkpoint is written at only sets how much each writing process holds: every rank
of a T x P x E layout (torchrun, or one process at 1 x 1 x 1) builds its stage of the model on the CPU, copies its
shard of each HF tensor into it (one tensor read at a time) and megatron saves the shards collectively.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint_tools._convert import _read_hf_config, check_layout
from checkpoint_tools._dist import DIST_MODEL_KEY, RELEASE, TRACKER, DistModelCard, cpu_stage, write_model_card
from checkpoint_tools._io import CheckpointError, atomic_output_dir, check_output, open_safetensors_dir
from checkpoint_tools._live import load_hf_into_stage
from checkpoint_tools._mapping import check_hf_names
from megatron_offgrpo.model import arch_from_hf_config, tokenizer_errors

logger = logging.getLogger(__name__)
MEGATRON_LM_CHECKPOINT_VERSION = 3.0  # Megatron-LM's current checkpoint_version (dist checkpoints)


def megatron_lm_common(tp: int, pp: int) -> dict:
    """The non-tensor state Megatron-LM's ``load_checkpoint`` reads from ``common.pt`` before the tensors: the saved
    TP/PP (a mismatch only skips the RNG state, which a release has none of) and the checkpoint version."""
    args = argparse.Namespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, no_save_rng=True,
                              no_save_optim=True)
    return {"args": args, "checkpoint_version": MEGATRON_LM_CHECKPOINT_VERSION, "iteration": 0}


def hf_to_dist_dir(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1,
                   overwrite: bool = False) -> Path:
    """Convert a HF Qwen directory into a megatron dist checkpoint at ``out`` (atomic; collective over the
    ``tp * pp * ep`` processes of a torchrun, or one process when all three are 1). Returns ``out``.

    Raises:
        ValueError: a layout the model cannot be split into, or a process count other than ``tp * pp * ep``.
        CheckpointError / KeyError / UnknownTensorError: naming the HF file or tensor at fault.
    """
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    hf_dir, out = Path(hf_dir), Path(out)
    hf_config = _read_hf_config(hf_dir)
    arch = arch_from_hf_config(hf_config)
    check_layout(arch, tp, pp, ep)
    # the checkpoint carries the tokenizer files to every export: one train and eval refuse is refused here too
    if errors := tokenizer_errors(hf_dir, "--hf", hf_dir):
        raise CheckpointError(errors[0])
    check_output(out, hf_dir, overwrite)  # before any process group or tensor: fail in a second
    tensors = open_safetensors_dir(hf_dir)
    check_hf_names(tensors.names(), arch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * pp * ep:
        raise ValueError(f"--tp {tp} --pp {pp} --ep {ep} is written by {tp * pp * ep} processes, not {world}: run "
                         f"`torchrun --nproc_per_node {tp * pp * ep} -m checkpoint_tools.hf_to_megatron ...` (the "
                         "layout only sets what each process holds: any layout loads it)")
    start = time.perf_counter()
    ctx = init_parallel(tp, pp, backend="gloo", ep=ep)
    rank = ctx.rank
    try:
        stage = _stage_with_hf_weights(arch, tensors, tensors.dtype(tensors.names()[0]), ctx)
        card = DistModelCard(hf_config, str(next(stage.parameters()).dtype).removeprefix("torch."), ctx.layout())
        if rank == 0:
            with atomic_output_dir(out, overwrite) as tmp:
                dist.broadcast_object_list([str(tmp)], src=0)
                _save(stage, tmp / RELEASE, tp, pp)
                write_model_card(tmp / RELEASE, card, [hf_dir])
                (tmp / TRACKER).write_text(RELEASE)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            _save(stage, Path(box[0]) / RELEASE, tp, pp)
    finally:
        destroy_parallel()
    if rank == 0:
        logger.info("HF -> megatron dist checkpoint (written at tp=%d pp=%d ep=%d, loadable at any) in %.2f s: %s",
                    tp, pp, ep, time.perf_counter() - start, out)
    return out


def _stage_with_hf_weights(arch, tensors, dtype: torch.dtype, ctx) -> torch.nn.Module:
    """This rank's stage (local spec, CPU, no random init) holding its shard of every HF tensor."""
    stage = cpu_stage(arch, dtype, ctx.tp_size, ctx.pp_size, ctx.ep_size, ctx.is_first_stage, ctx.is_last_stage)
    with torch.no_grad():
        load_hf_into_stage(stage, arch, tensors, ctx.tp_size, ctx.tp_rank, ctx.pp_size, ctx.pp_rank, ctx.ep_size,
                           ctx.ep_rank, ctx.expert_tp_size, ctx.expert_tp_rank)
    return stage


def _save(stage: torch.nn.Module, directory: Path, tp: int, pp: int) -> None:
    """Every rank's shards and rank 0's common state into ``directory`` (collective)."""
    from megatron.core import dist_checkpointing

    from megatron_offgrpo.runtime import use_in_process_save_queue

    use_in_process_save_queue()
    if dist.get_rank() == 0:
        directory.mkdir()
    dist.barrier()
    dist_checkpointing.save({DIST_MODEL_KEY: stage.sharded_state_dict(), **megatron_lm_common(tp, pp)},
                            str(directory))
    dist.barrier()
