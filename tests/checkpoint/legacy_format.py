"""The per-rank safetensors checkpoint directory that earlier versions' ``hf_to_megatron`` wrote, reproduced here so
the reader that still exports such checkpoints (``MegatronCheckpoint``, ``megatron_to_hf_dir``) stays tested: the
package no longer writes the format (``hf-to-megatron`` writes megatron dist checkpoints).

The layout is the one ``checkpoint_tools/_convert.py`` describes: ``megatron_meta.json``, one
``mp_rank_TT_PPP[_EEE]/model.safetensors`` per (TP rank, PP stage[, EP rank when ep > 1]), ``hf_extra/`` and
``offgrpo_manifest.json``. The shards are cut by the package's weight map (``shard_for_tp``, experts chunked over EP),
so HF -> this -> ``megatron_to_hf_dir`` -> HF checks the map's split against the reader's merge.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from checkpoint_tools import _mapping as M
from checkpoint_tools._convert import META, check_layout, rank_dir
from checkpoint_tools._io import copy_extra_files, open_safetensors_dir, tensor_record, write_manifest
from megatron_offgrpo.model import arch_from_hf_config


def write_legacy_checkpoint(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, ep: int = 1) -> Path:
    """Write the HF model at ``hf_dir`` as an earlier version's TP x PP (x EP) checkpoint directory ``out``."""
    hf_dir, out = Path(hf_dir), Path(out)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    arch = arch_from_hf_config(hf_config)
    check_layout(arch, tp, pp, ep)
    hf = open_safetensors_dir(hf_dir)
    out.mkdir()
    records = {}
    for p in range(pp):
        offset = M.layers_of_stage(arch, pp, p).start
        ranks = {(t, e): {} for t in range(tp) for e in range(ep)}
        for local in M.full_megatron_names(arch, pp, p):  # stage-local layer indices, as megatron names them
            full = M.hf_to_megatron(M.to_global_layer(local, offset), arch, hf)
            kind = M.split_kind(local)
            for (t, e), tensors in ranks.items():
                part = full.chunk(ep)[e] if M.is_expert_kind(kind) else full  # every EP rank holds the dense tensors
                tensors[local] = M.shard_for_tp(part, kind, tp, t).contiguous()
        for (t, e), tensors in ranks.items():
            sub = rank_dir(t, p, e if ep > 1 else None)
            (out / sub).mkdir()
            save_file(tensors, out / sub / "model.safetensors")
            records.update({f"{sub}/{name}": tensor_record(x, "model.safetensors") for name, x in tensors.items()})
    (out / "hf_extra").mkdir()
    copy_extra_files(hf_dir, out / "hf_extra")
    (out / META).write_text(json.dumps({"tp": tp, "pp": pp, "ep": ep, "hf_config": hf_config, "spec": "local"}))
    write_manifest(out, "megatron", records, {"tp": tp, "pp": pp, "ep": ep})  # last: it marks the write complete
    return out
