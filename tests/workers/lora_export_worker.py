"""torchrun worker: a LoRA model at this torchrun's TP x PP, exported merged and adapter only, scored, and saved.

Every rank builds its stage from the HF directory (local spec, CPU, fp32), attaches the model room's adapters holding
its shards of the test's whole factors (``lora_fixture``: rank 4, alpha 8, seed 1, every target the arch has), and
streams both exports through the trainer's ``export_buckets`` (TP gathers, PP stages sending to rank 0). Rank 0 writes
``OUT/merge.safetensors``, ``OUT/only.safetensors``, the trainer's log-probs of ``PROBE`` (``OUT/probe.json``), and
the model is saved as a dist checkpoint with the trainer's card (``OUT/ckpt``), for the test to hold against one
process's whole-tensor math, PEFT's forward and ``offgrpo convert``.
Args: HF_DIR OUT TP PP
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from checkpoint_tools import adapters, dist_ckpt, load_hf_into_stage, open_safetensors_dir
from checkpoint_tools import _mapping as M
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import destroy_parallel, init_parallel
from megatron_offgrpo.train._trainer_side import probe_logprobs
from megatron_offgrpo.train._weights import export_buckets, model_card
from tests.checkpoint.lora_fixture import ALL, ATTENTION, attach, full_adapters

PROBE = [3, 17, 250, 9, 128, 64, 5, 77, 200, 1, 42, 99, 7, 31]


def card_for(arch) -> adapters.LoraCard:
    return adapters.LoraCard(rank=4, alpha=8.0, targets=ATTENTION if arch.is_moe else ALL)


def lora_stage(hf_dir: Path, ctx) -> tuple[torch.nn.Module, object]:
    """This rank's stage with the HF weights and its shards of the fixture's adapters."""
    arch = load_arch(hf_dir)
    stage = dist_ckpt.cpu_stage(arch, torch.float32, ctx.tp_size, ctx.pp_size, 1, ctx.is_first_stage,
                                ctx.is_last_stage)
    load_hf_into_stage(stage, arch, open_safetensors_dir(hf_dir), ctx.tp_size, ctx.tp_rank, ctx.pp_size,
                       ctx.pp_rank)
    card = card_for(arch)
    attach(stage, card, full_adapters(arch, card, seed=1), ctx.tp_size, ctx.tp_rank,
           M.layers_of_stage(arch, ctx.pp_size, ctx.pp_rank).start)
    return stage, arch


def export_both(stage, arch, ctx) -> dict[str, dict[str, torch.Tensor]]:
    """Both exports on global rank 0 (empty elsewhere): every rank must call it."""
    out = {}
    for mode in ("merge", "only"):
        out[mode] = {name: t.clone() for bucket in export_buckets(stage, arch, ctx, bucket_bytes=1 << 16,
                                                                 adapter=mode) for name, t in bucket}
    return out


def main() -> None:
    hf_dir, out, tp, pp = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ctx = init_parallel(tp, pp, 1234, backend="gloo")
    stage, arch = lora_stage(hf_dir, ctx)
    exported = export_both(stage, arch, ctx)
    from megatron_offgrpo.model import expose_hidden_states

    logp = probe_logprobs(expose_hidden_states(stage), ctx, PROBE)  # as the trainer's stage: hidden states out
    save_dist(stage, arch, ctx, hf_dir, out / "ckpt")
    if ctx.rank == 0:
        for mode, tensors in exported.items():
            save_file(tensors, out / f"{mode}.safetensors")
        (out / "probe.json").write_text(json.dumps({"probe": PROBE, "logp": logp}))
        print("LORA_EXPORT written", flush=True)
    destroy_parallel()


def save_dist(stage, arch, ctx, hf_dir: Path, directory: Path) -> None:
    """The stage's model part as the trainer saves it (megatron dist checkpoint, adapters' own shardings) and the
    trainer's card (collective)."""
    from checkpoint_tools._dist_write import _save

    _save(stage, directory, ctx.tp_size, ctx.pp_size)
    if ctx.rank == 0:
        dist_ckpt.write_model_card(directory, model_card(stage, arch, ctx, hf_dir), [hf_dir])


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)
