"""The per-rank safetensors checkpoint directories of earlier versions, read only, and the HF directory writer.

``hf-to-megatron`` writes megatron dist checkpoints (``_dist_write``). Earlier versions wrote their own per-rank
format, which is read here so that such checkpoints still export to HF (``megatron-to-hf``):
    megatron_meta.json                  {"tp", "pp", "ep", "hf_config", "spec"}
    mp_rank_{tp:02d}_{pp:03d}[_{ep:03d}]/model.safetensors   one file per (TP rank, PP stage[, EP rank when ep > 1]),
                                        megatron local-spec names; a MoE layer's experts as its EP rank's stack
                                        (``decoder.layers.{i}.mlp.experts.linear_fc1.weight`` [E/ep, 2I/tp, H]), the
                                        other tensors in every EP rank's file
    hf_extra/                           generation config and tokenizer files carried to the HF export
    offgrpo_manifest.json               written last: every tensor's shape, dtype and CRC-32
The export holds one full tensor of the checkpoint at a time and at most one HF shard, and writes into an
``atomic_output_dir``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from checkpoint_tools import _mapping as M
from checkpoint_tools._io import (
    CheckpointError,
    SafetensorsFiles,
    atomic_output_dir,
    check_output,
    copy_extra_files,
    read_manifest,
    write_manifest,
    write_sharded,
)
from checkpoint_tools._shapes import hf_shapes
from megatron_offgrpo.model import QwenArch, arch_from_hf_config, hf_config_dict

logger = logging.getLogger(__name__)
META = "megatron_meta.json"


def rank_dir(tp_rank: int, pp_rank: int, ep_rank: int | None = None) -> str:
    """Sub-directory of one (TP rank, PP stage[, EP rank]), Megatron-LM's ``mp_rank_TT_PPP[_EEE]`` naming."""
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" + ("" if ep_rank is None else f"_{ep_rank:03d}")


def _read_hf_config(hf_dir: Path) -> dict:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a HF model directory needs config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


class MegatronCheckpoint:
    """Lazy reader of a per-rank checkpoint directory of earlier versions (any TP x PP x EP): full (TP- and, for
    experts, EP-merged) tensors by global name."""

    def __init__(self, directory: str | Path) -> None:
        """Raises: CheckpointError naming the file when the directory is incomplete or corrupt."""
        self.directory = Path(directory)
        meta_path = self.directory / META
        if not meta_path.is_file():
            raise CheckpointError(f"{meta_path}: missing: {self.directory} is not a complete megatron checkpoint")
        try:
            meta = json.loads(meta_path.read_text())
            self.hf_config: dict = meta["hf_config"]
            self.tp, self.pp, self.ep = int(meta["tp"]), int(meta["pp"]), int(meta.get("ep", 1))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{meta_path}: corrupt ({type(exc).__name__}: {exc})") from None
        self.arch: QwenArch = arch_from_hf_config(self.hf_config)
        try:  # a layout no writer could produce (tp=-2 from an older, unchecked hf_to_megatron) is a corrupt file
            check_layout(self.arch, self.tp, self.pp, self.ep)
        except ValueError as exc:
            raise CheckpointError(f"{meta_path}: {exc}") from None
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise CheckpointError(f"{self.directory}: no manifest: the checkpoint was not completely written")
        records = manifest["tensors"]
        self._shards = {}
        for t in range(self.tp):
            for p in range(self.pp):
                for e in range(self.ep):
                    name = rank_dir(t, p, e if self.ep > 1 else None)
                    sub_records = {k[len(name) + 1:]: v for k, v in records.items() if k.startswith(name + "/")}
                    files = {key: self.directory / name / rec["file"] for key, rec in sub_records.items()}
                    if not (self.directory / name / "model.safetensors").is_file():
                        raise CheckpointError(f"{self.directory / name / 'model.safetensors'}: shard file is missing")
                    self._shards[(t, p, e)] = SafetensorsFiles(files, sub_records)

    def global_names(self) -> list[str]:
        """Megatron names with global layer indices, in model order."""
        return M.full_megatron_names(self.arch)

    def _locate(self, global_name: str) -> tuple[M.Rule, int, str]:
        """(rule, PP stage, stage-local name) of a global megatron name."""
        if global_name == "output_layer.weight" and self.arch.tie_word_embeddings:
            global_name = "embedding.word_embeddings.weight"
        rule, layer = M.rule_for_megatron(global_name)
        if rule.stage == "first":
            return rule, 0, global_name
        if rule.stage == "last":
            return rule, self.pp - 1, global_name
        per_stage = self.arch.num_layers // self.pp
        stage = layer // per_stage
        return rule, stage, M.to_global_layer(global_name, -stage * per_stage)

    def dtype(self, global_name: str) -> torch.dtype:
        """Stored dtype of a global megatron name (from the header, no data read)."""
        _, stage, local = self._locate(global_name)
        return self._shards[(0, stage, 0)].dtype(local)

    def full(self, global_name: str) -> torch.Tensor:
        """The TP-merged (and for experts EP-merged) tensor of a global megatron name."""
        rule, stage, local = self._locate(global_name)
        ep_ranks = range(self.ep) if M.is_expert_kind(rule.split) else range(1)
        return torch.cat([M.merge_tp([self._shards[(t, stage, e)][local] for t in range(self.tp)], rule.split)
                          for e in ep_ranks])


def check_layout(arch: QwenArch, tp: int, pp: int, ep: int = 1) -> None:
    """Refuse a TP x PP (x EP) layout before anything is read or written: sizes >= 1 that divide the model.

    Raises:
        ValueError: one naming the size (``tp``/``pp``/``ep`` and the value) or the config field it does not divide.
    """
    for flag, size, what in (("tp", tp, "tensor"), ("pp", pp, "pipeline"), ("ep", ep, "expert")):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{flag}={size!r}: the {what}-parallel size must be an integer >= 1")
    arch.check_layout(tp, pp, ep)  # after: a size of 0 would divide by zero there


def _installed_version(package: str, default: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return default


def iter_hf_tensors(arch: QwenArch, full_fn: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of the whole model from a full-tensor source, in model order."""
    for global_name in M.full_megatron_names(arch):
        yield from M.megatron_to_hf(global_name, full_fn(global_name), arch)


def write_hf(
    out: Path,
    arch: QwenArch,
    hf_config: dict,
    tensors: Iterator[tuple[str, torch.Tensor]],
    dtype_fn: Callable[[str], torch.dtype],
    extra_src: Path | Sequence[Path] | None,
    max_shard_bytes: int = 2 * 1024**3,
    overwrite: bool = False,
) -> Path:
    """Write a loadable HF directory (sharded safetensors + index, config, generation config, tokenizer; atomic).

    Args:
        tensors: HF (name, tensor) pairs in ``hf_names(arch)`` order, produced lazily.
        dtype_fn: the dtype each HF tensor will have (declared in the shard headers before data is written).
        extra_src: directories the generation config and tokenizer files are copied from, in order (later files
            win), inside the atomic write.
    """
    specs = [(name, dtype_fn(name), shape) for name, shape in hf_shapes(arch).items()]
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        records = write_sharded(tmp, specs, tensors, max_shard_bytes)
        config = hf_config_dict(arch, hf_config)
        config["torch_dtype"] = str(specs[0][1]).removeprefix("torch.")
        # As save_pretrained does; without it transformers >= 5 suspects an old Mistral tokenizer regex and warns.
        config.setdefault("transformers_version", _installed_version("transformers", "5.0.0"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for src in [extra_src] if isinstance(extra_src, Path) else extra_src or ():
            if src.is_dir():
                copy_extra_files(src, tmp)
        write_manifest(tmp, "hf", records, {"architecture": arch.hf_architecture})
    return out


def megatron_to_hf_dir(
    ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False
) -> Path:
    """Export a per-rank checkpoint directory of earlier versions (any TP x PP x EP) to a HF directory at ``out``."""
    src = MegatronCheckpoint(ckpt)
    check_output(Path(out), src.directory, overwrite)
    start = time.perf_counter()
    write_hf(Path(out), src.arch, src.hf_config, iter_hf_tensors(src.arch, src.full),
             lambda n: src.dtype(M.megatron_global_name_for_hf(n)), src.directory / "hf_extra", max_shard_bytes,
             overwrite)
    logger.info("megatron tp=%d pp=%d ep=%d -> HF in %.2f s: %s", src.tp, src.pp, src.ep, time.perf_counter() - start,
                out)
    return Path(out)

