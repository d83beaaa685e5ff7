"""The megatron distributed checkpoints, the project's one megatron format: their self-description, their model part
loaded into a stage of any layout (``model.init=megatron``) and their export to a HF directory.

``offgrpo train`` saves megatron ``dist_checkpointing`` directories (``RUN/checkpoints/step_N``), sharded by every
rank of whatever TP x PP x DP layout (and distributed optimizer) the run used. Such a checkpoint is reshardable, so
one process can read it back at TP1/PP1: build the model from the checkpoint's own description, load only the
model part of the sharded state dict, stream it through the one weight map into ``write_hf``.

Where this lives: checkpoint_tools, not train/. The reader needs only the model room (architecture, builder), the
runtime room (a one-process gloo group and megatron's CPU layer) and this room's weight map, so both
``python -m checkpoint_tools.megatron_to_hf`` and ``offgrpo convert megatron-to-hf`` accept a trainer checkpoint
without checkpoint_tools importing train/ (which imports checkpoint_tools: that would be a cycle). The trainer
writes its checkpoints' description through this module's public API (``DistModelCard``, ``write_model_card``,
``DIST_MODEL_KEY``), so the format has one owner.

``hf-to-megatron`` writes the same format (``_dist_write``: model part only, in Megatron-LM's ``--load`` layout).
A dist checkpoint directory, besides megatron's files (``metadata.json``, ``common.pt``, ``*.distcp``):
    offgrpo_model.json   {"format", "hf_config", "params_dtype", "layout"[, "lora"]}: rebuilds the model without the
                         recipe ("lora": {"rank", "alpha", "targets", "dropout"} when the model has adapters)
    hf_extra/            generation config and tokenizer files carried to the HF export
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Literal, Sequence

import torch

from checkpoint_tools._adapter import AdapterExport, LoraCard, write_peft
from checkpoint_tools._check import dist_dir_errors
from checkpoint_tools._convert import META, megatron_to_hf_dir, write_hf
from checkpoint_tools._io import CheckpointError, check_output, copy_extra_files
from checkpoint_tools._live import stream_hf_buckets
from megatron_offgrpo.model import QwenArch, arch_from_hf_config

logger = logging.getLogger(__name__)
CARD = "offgrpo_model.json"
CARD_FORMAT = "megatron-offgrpo-dist/1"
DIST_METADATA = "metadata.json"  # written by megatron dist_checkpointing.save
DIST_MODEL_KEY = "model"  # the model's part of the trainer's sharded state dict (the optimizer's is "optimizer")
HF_EXTRA = "hf_extra"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's: names the checkpoint directory of a --load directory
RELEASE = "release"  # the tracker's tag (and directory) of a converted checkpoint, as Megatron-LM's converters write


@dataclasses.dataclass(frozen=True)
class DistModelCard:
    """What rebuilds the model of a trainer checkpoint without the recipe (``offgrpo_model.json``).

    Attributes:
        hf_config: the HF ``config.json`` of the architecture (with the source model's token ids).
        params_dtype: dtype name of the saved parameters ("float32", "bfloat16"), and of the HF export.
        layout: {"tp", "pp", "dp", "ep", "etp"} of the run that saved it (informational: loading reshards; "ep" and
            "etp" absent from checkpoints written before MoE support, "etp" from those before ``parallel.etp``).
        lora: the model's LoRA adapters (rank, alpha, targets), whose factors the checkpoint holds beside the frozen
            base; None (absent from the file): no adapters.
    """

    hf_config: dict
    params_dtype: str
    layout: dict
    lora: LoraCard | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The parameters' torch dtype."""
        return getattr(torch, self.params_dtype)


def write_model_card(directory: Path, card: DistModelCard, extra_dirs: Sequence[Path] = ()) -> None:
    """Describe the model of the checkpoint being written at ``directory``; rank 0 only.

    Args:
        extra_dirs: where the generation config and tokenizer files come from, copied in order (later files win),
            so the export never depends on the recipe's relative paths.
    """
    (directory / HF_EXTRA).mkdir(exist_ok=True)
    for src in extra_dirs:
        if src.is_dir():
            copy_extra_files(src, directory / HF_EXTRA)
    body = {"format": CARD_FORMAT, "hf_config": card.hf_config, "params_dtype": card.params_dtype,
            "layout": card.layout}
    if card.lora is not None:  # absent, not null, without adapters: the cards of earlier versions read the same
        body["lora"] = card.lora.to_dict()
    (directory / CARD).write_text(json.dumps(body, indent=1))


def read_model_card(directory: Path) -> DistModelCard:
    """The card of a trainer checkpoint. Raises: CheckpointError naming the file when it is missing or corrupt."""
    path = directory / CARD
    if not path.is_file():
        raise CheckpointError(f"{path}: missing: this trainer checkpoint predates HF export (resume the run with "
                              "the current offgrpo to write a checkpoint that carries its model)")
    try:
        body = json.loads(path.read_text())
        lora = LoraCard.from_dict(body["lora"]) if body.get("lora") is not None else None
        card = DistModelCard(body["hf_config"], body["params_dtype"], body["layout"], lora)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt model card ({type(exc).__name__}: {exc})") from None
    if not isinstance(getattr(torch, card.params_dtype, None), torch.dtype):
        raise CheckpointError(f"{path}: params_dtype={card.params_dtype!r} is not a torch dtype")
    return card


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: itself; for a Megatron-LM layout (``hf-to-megatron``'s output, or
    Megatron-LM's ``--save``) the one its ``latest_checkpointed_iteration.txt`` names; for a run directory
    (``RUN/checkpoints/step_N/...``) its newest complete checkpoint.

    Raises:
        CheckpointError: a run directory without a complete checkpoint (only ``.tmp`` saves, or none), or a tracker
            naming a directory that is not there.
    """
    path = Path(path)
    if (path / TRACKER).is_file():
        tag = (path / TRACKER).read_text().strip()
        named = path / (tag if tag == RELEASE else f"iter_{int(tag):07d}" if tag.isdigit() else tag)
        if not named.is_dir():
            raise CheckpointError(f"{path / TRACKER} names {tag!r}, but {named} is not there")
        return named
    if not (path / "checkpoints").is_dir() or (path / META).is_file() or (path / DIST_METADATA).is_file():
        return path
    # a save is renamed from step_N.tmp into place only when every rank finished (train/_checkpoint.py)
    done = sorted(p for p in (path / "checkpoints").glob("step_*")
                  if not p.name.endswith(".tmp") and (p / DIST_METADATA).is_file())
    if not done:
        raise CheckpointError(f"{path}: a run directory without a complete checkpoint under {path / 'checkpoints'}")
    return done[-1]


def checkpoint_kind(path: str | Path) -> str:
    """"dist" (megatron dist_checkpointing: ``hf-to-megatron``'s output, a trainer's ``RUN/checkpoints/step_N``, or
    ``RUN``: its newest) or "tools" (the per-rank safetensors directories of earlier versions, read only).

    Raises:
        CheckpointError: one line naming the path when it is neither.
    """
    path = resolve_checkpoint(path)
    if (path / META).is_file():
        return "tools"
    if (path / DIST_METADATA).is_file():
        return "dist"
    hint = " (an unfinished save: pass a complete step_N directory)" if path.name.endswith(".tmp") else ""
    raise CheckpointError(f"{path}: not a megatron checkpoint: expected a dist checkpoint ({DIST_METADATA}, {CARD}: "
                          f"hf-to-megatron's output or a trainer's RUN/checkpoints/step_N), a run directory{hint}, "
                          f"or a checkpoint_tools directory of an earlier version ({META})")


def load_model_part(model: torch.nn.Module, ckpt: Path) -> None:
    """Load the model part of the dist checkpoint ``ckpt`` into ``model``, this rank's stage of any TP/PP/EP layout
    (megatron reshards; the optimizer's part stays on disk). Collective over the model's process groups.

    Raises:
        CheckpointError: megatron cannot read it (incomplete, corrupt, or another model's shapes).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = dist_checkpointing.load({DIST_MODEL_KEY: model.sharded_state_dict()}, str(ckpt))
    except (CheckpointingException, CheckpointException) as exc:
        raise CheckpointError(f"{ckpt}: megatron could not read the model part ({_reason(exc)}): the checkpoint "
                              "is incomplete, corrupt or of another model") from None
    model.load_state_dict(loaded[DIST_MODEL_KEY])


def cpu_stage(arch: QwenArch, dtype: torch.dtype, tp: int = 1, pp: int = 1, ep: int = 1, pre_process: bool = True,
              post_process: bool = True) -> torch.nn.Module:
    """A stage of the model on the CPU (local spec) with uninitialised parameters, for a load or a conversion that
    overwrites every one of them (the process group of that layout must exist)."""
    from megatron_offgrpo.model import build_gpt_stage, transformer_config

    config = transformer_config(arch, tp, pp, params_dtype=dtype, use_cpu_initialization=True,
                                perform_initialization=False, ep=ep, use_te=False)
    return build_gpt_stage(arch, config, pre_process=pre_process, post_process=post_process, use_te=False)


def _load_model(ckpt: Path, arch: QwenArch, dtype: torch.dtype, lora: LoraCard | None) -> torch.nn.Module:
    """The whole model (TP1/PP1, local spec, on CPU) with the checkpoint's weights, and its adapters when the card
    lists them (their factors are part of the model's sharded state dict); the process group must exist."""
    model = cpu_stage(arch, dtype)  # CPU: the export streams from host memory
    if lora is not None:  # the model room owns the adapter modules and their checkpoint entries; values: the load's
        from megatron_offgrpo.model import lora as model_lora

        model_lora.attach_lora(model, model_lora.LoraSpec(lora.rank, lora.alpha, lora.dropout, lora.targets))
    load_model_part(model, ckpt)
    return model.eval()


def _reason(exc: BaseException) -> str:
    """One line for a failed load: torch's ``CheckpointException`` wraps each rank's error with its traceback."""
    failures = getattr(exc, "failures", None)
    if failures:
        exc = next(iter(failures.values()))[0]
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _single_process_group() -> bool:
    """Start a one-process group and megatron's state at TP1/PP1 (with the CPU layer); True when started here.

    Raises:
        ValueError: already inside a group of several processes (the reader reshards in one process).
    """
    import torch.distributed as dist

    from megatron_offgrpo.runtime import init_parallel

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ValueError(f"the trainer-checkpoint export runs in one process, not under torchrun "
                             f"(world_size={dist.get_world_size()})")
        return False
    init_parallel(1, 1, backend="gloo")
    return True


ExportKind = Literal["merged", "adapter"]
"""What a checkpoint export writes: the HF model (``merged``: any LoRA adapter merged into its weights) or the LoRA
adapter alone as a PEFT directory (``adapter``)."""


def _checked_dist(ckpt: str | Path, out: Path, overwrite: bool, what: ExportKind) -> tuple[Path, DistModelCard]:
    """The dist checkpoint ``ckpt`` names and its card, once everything that can be refused before the load is
    checked (in a second: not megatron's load failing halfway)."""
    ckpt = resolve_checkpoint(ckpt)
    if checkpoint_kind(ckpt) != "dist":
        raise CheckpointError(f"{ckpt}: a checkpoint_tools directory, not a dist checkpoint")
    card = read_model_card(ckpt)
    if what == "adapter" and card.lora is None:
        raise CheckpointError(f"{ckpt}: --what adapter: this checkpoint has no LoRA adapter (its {CARD} lists none); "
                              "its model exports with --what merged")
    check_output(out, ckpt, overwrite)
    if errors := dist_dir_errors(ckpt):
        raise CheckpointError("; ".join(errors))
    return ckpt, card


def dist_checkpoint_to_hf_dir(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 * 1024**3,
                              overwrite: bool = False, what: ExportKind = "merged",
                              base_model: str | None = None) -> Path:
    """Export a trainer checkpoint of any TP x PP x DP layout to a HF directory at ``out`` (atomic, one process):
    the model, any LoRA adapter merged in (``what="merged"``), or the adapter as a PEFT directory (``"adapter"``,
    ``base_model`` written as its ``base_model_name_or_path``).

    Raises:
        CheckpointError: ``ckpt`` is not a complete trainer checkpoint, or ``what="adapter"`` and it has no adapter.
        FileExistsError: ``out`` exists.
    """
    out = Path(out)
    ckpt, card = _checked_dist(ckpt, out, overwrite, what)
    arch = arch_from_hf_config(card.hf_config)
    start = time.perf_counter()
    started = _single_process_group()
    try:
        model = _load_model(ckpt, arch, card.dtype, card.lora)
        adapter: AdapterExport = "only" if what == "adapter" else "merge"
        pairs = (pair for bucket in stream_hf_buckets(model, arch, adapter=adapter) for pair in bucket)
        if what == "adapter":
            write_peft(out, card.lora, arch, pairs, base_model, overwrite)
        else:
            write_hf(out, arch, card.hf_config, pairs, lambda _: card.dtype, ckpt / HF_EXTRA, max_shard_bytes,
                     overwrite)
    finally:
        if started:
            from megatron_offgrpo.runtime import destroy_parallel

            destroy_parallel()
    layout = card.layout
    logger.info("dist checkpoint (saved at tp=%s pp=%s dp=%s ep=%s etp=%s) -> %s in %.2f s: %s", layout.get("tp"),
                layout.get("pp"), layout.get("dp"), layout.get("ep", 1), layout.get("etp", layout.get("tp")),
                "PEFT adapter" if what == "adapter" else "HF", time.perf_counter() - start, out)
    return out


def megatron_to_hf_any(ckpt: str | Path, out: str | Path, max_shard_bytes: int = 2 * 1024**3,
                       overwrite: bool = False, what: ExportKind = "merged", base_model: str | None = None) -> Path:
    """``megatron-to-hf`` for either kind of checkpoint (detected from its files); ``what``, ``base_model``: as
    ``dist_checkpoint_to_hf_dir`` (a checkpoint_tools directory of an earlier version has no adapter).

    Raises:
        CheckpointError: ``what="adapter"`` for a checkpoint without an adapter, and as the exports raise.
    """
    if checkpoint_kind(ckpt) == "dist":
        return dist_checkpoint_to_hf_dir(ckpt, out, max_shard_bytes, overwrite, what, base_model)
    if what == "adapter":
        raise CheckpointError(f"{ckpt}: --what adapter: a checkpoint_tools directory of an earlier version has no "
                              "LoRA adapter; its model exports with --what merged")
    return megatron_to_hf_dir(ckpt, out, max_shard_bytes, overwrite)
