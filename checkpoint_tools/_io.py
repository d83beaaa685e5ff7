"""Checkpoint files: atomic output directories, manifests with checksums, lazy readers, a streaming HF writer.

Nothing here knows tensor names; ``_mapping`` does. Every error names the file (and tensor) at fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

MANIFEST = "offgrpo_manifest.json"
HF_INDEX = "model.safetensors.index.json"
HF_EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, corrupt or does not match its manifest/config."""


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's raw bytes (zero-copy for contiguous CPU tensors)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(flat.numpy()) & 0xFFFFFFFF


def tensor_record(tensor: torch.Tensor, file: str) -> dict[str, Any]:
    """The manifest entry of one tensor."""
    return {"file": file, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."), "crc32": tensor_crc32(tensor)}


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to write into; rename it to ``out`` only when the block succeeds.

    A crash or an exception leaves no directory at ``out`` (an interrupted run leaves a ``.tmp-`` sibling that no
    reader mistakes for a checkpoint: it has no final name). With ``overwrite``, an existing ``out`` is replaced
    only after the new one is complete.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists: pass --overwrite to replace it, or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_manifest(directory: Path, kind: str, tensors: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
    """Write the manifest last: its presence marks a complete checkpoint."""
    body = {"format": "megatron-offgrpo/1", "kind": kind, "meta": meta, "tensors": tensors}
    (directory / MANIFEST).write_text(json.dumps(body, indent=1, sort_keys=True))


def read_manifest(directory: Path) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it has none (e.g. a HF download)."""
    path = directory / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt manifest ({exc})") from None


class SafetensorsFiles:
    """Lazy access to tensors spread over several safetensors files, verified against a manifest when given."""

    def __init__(self, files: dict[str, Path], manifest: dict[str, Any] | None = None) -> None:
        """Args: files: tensor name -> file holding it. manifest: tensor name -> record (checksum, shape)."""
        self._files = files
        self._handles: dict[Path, Any] = {}
        self._manifest = manifest or {}

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc})") from None
        return self._handles[path]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        path = self._files[name]
        try:
            tensor = self._open(path).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({exc})") from None
        record = self._manifest.get(name)
        if record is not None and (list(tensor.shape) != record["shape"] or tensor_crc32(tensor) != record["crc32"]):
            raise CheckpointError(
                f"{path}: tensor {name!r} does not match the manifest (shape {list(tensor.shape)} vs "
                f"{record['shape']}, or checksum): the file is corrupt"
            )
        return tensor


def open_safetensors_dir(directory: Path, index_name: str = HF_INDEX) -> SafetensorsFiles:
    """Open a HF-style directory: ``model.safetensors`` alone, or shards listed by ``model.safetensors.index.json``.

    Raises:
        CheckpointError: no weights, an index naming a missing shard, or an unreadable header.
    """
    index = directory / index_name
    manifest = read_manifest(directory)
    records = (manifest or {}).get("tensors", {})
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: corrupt index ({exc})") from None
        files = {name: directory / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file listed in {index.name} is missing")
    else:
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{directory}: no *.safetensors weights and no {index_name}")
        files = {}
        for path in shards:
            try:
                with safe_open(str(path), framework="pt") as handle:
                    files.update({name: path for name in handle.keys()})
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({exc})") from None
    reader = SafetensorsFiles(files, records)
    for path in sorted(set(files.values())):
        reader._open(path)  # fail early, naming the file, on a truncated header or data section
    return reader


class ShardedSafetensorsWriter:
    """Writes tensors as they come into HF-style shards of at most ``max_shard_bytes``; never holds more."""

    def __init__(self, directory: Path, max_shard_bytes: int = 2 * 1024**3) -> None:
        """Args: directory: where to write (an ``atomic_output_dir``). max_shard_bytes: shard size bound."""
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.records: dict[str, dict[str, Any]] = {}
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Queue one tensor; writes a shard when the queue reaches the bound."""
        if name in self.records or name in self._pending:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous()
        self._pending_bytes += nbytes

    def _flush(self) -> None:
        fname = f".shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.directory / fname), metadata={"format": "pt"})
        for name, tensor in self._pending.items():
            self.records[name] = tensor_record(tensor, fname)
        self.total_bytes += self._pending_bytes
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> dict[str, dict[str, Any]]:
        """Write the last shard, give shards their final names and (if several) the index. Returns records."""
        if self._pending or not self._shards:
            self._flush()
        count = len(self._shards)
        final = ["model.safetensors"] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        weight_map = {}
        for k, names in enumerate(self._shards):
            (self.directory / f".shard-{k:05d}.safetensors").rename(self.directory / final[k])
            for name in names:
                self.records[name]["file"] = final[k]
                weight_map[name] = final[k]
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.directory / HF_INDEX).write_text(json.dumps(index, indent=2))
        return self.records


def copy_extra_files(src: Path, dst: Path) -> list[str]:
    """Copy generation config and tokenizer files that exist in ``src``; returns their names."""
    copied = []
    for name in HF_EXTRA_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
