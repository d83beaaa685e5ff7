"""Checkpoint files: atomic output directories, manifests with checksums, lazy readers, a streaming HF writer.

Nothing here knows tensor names; ``_mapping`` does. Every error names the file (and tensor) at fault.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import shutil
import socket
import uuid
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch

from megatron_offgrpo.runtime import process_alive
from checkpoint_tools._safetensors_stream import (
    CODE_DTYPES,
    SafetensorsFormatError,
    StreamingSafetensorsWriter,
    _nbytes,
    read_header,
    read_tensor,
)

logger = logging.getLogger(__name__)
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
    return {"file": file, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
            "crc32": tensor_crc32(tensor)}


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of ``out`` to write into; rename it to ``out`` only when the block succeeds.

    A crash or an exception leaves no directory at ``out``. A run killed outright (SIGKILL, OOM killer) leaves its
    ``.NAME.tmp-PID-HOST-HEX`` sibling, which no reader mistakes for a checkpoint (it has no final name); the next
    write to the same ``out`` removes it once that PID is no longer running on this host. With ``overwrite``, an
    existing ``out`` is replaced only after the new one is complete.

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists: pass --overwrite to replace it, or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_siblings(out)
    tmp = out.parent / f".{out.name}.tmp-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{_owner_tag()}-{uuid.uuid4().hex[:8]}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _owner_tag() -> str:
    """``PID-HOST``: who writes a temporary directory; HOST (CRC-32 of the hostname) keeps a shared filesystem's
    other machines' PIDs from being judged by this machine's process table."""
    return f"{os.getpid()}-{zlib.crc32(socket.gethostname().encode()) & 0xFFFFFFFF:08x}"


def sweep_stale_siblings(out: Path) -> list[Path]:
    """Remove ``.NAME.tmp-*`` (and, once ``out`` exists, ``.NAME.old-*``) siblings of ``out`` left by killed writers.

    Only directories whose PID is no longer running on this host are removed; a live writer's, another host's or an
    unparsable one stays. ``.old-`` is kept while ``out`` is missing: a kill between the two renames of an overwrite
    leaves it as the only copy. Names without a host (written before the host tag existed) are judged locally.
    """
    host = _owner_tag().split("-")[1]
    removed = []
    kinds = ("tmp", "old") if out.exists() else ("tmp",)
    for kind in kinds:
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            match = _STALE.fullmatch(path.name[len(out.name) + len(kind) + 3:])
            if not match or not path.is_dir() or match["host"] not in (None, host) or process_alive(int(match["pid"])):
                continue
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s: left by a killed conversion (pid %s is no longer running)", path, match["pid"])
            removed.append(path)
    return removed


_STALE = re.compile(r"(?P<pid>\d+)-(?:(?P<host>[0-9a-f]{8})-)?[0-9a-f]{8}")
_MODEL_MARKERS = (MANIFEST, "config.json", "megatron_meta.json", "latest_checkpointed_iteration.txt")


def check_output(out: Path, source: Path, overwrite: bool, has_overwrite_flag: bool = True) -> None:
    """Refuse, before any work, an ``--out`` that would delete or pollute ``source`` or replace unrelated files.

    ``--overwrite`` replaces only an empty directory or an earlier output (a directory with an offgrpo manifest, a
    HF ``config.json`` or a ``megatron_meta.json``): a directory of anything else is someone's data.

    Args:
        has_overwrite_flag: whether the command offers ``--overwrite`` (picks the fix the message suggests).

    Raises:
        ValueError: ``out`` is ``source``, contains it or lies inside it; or is a file or a directory of other files.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    out_real, src_real = out.resolve(), source.resolve()
    if out_real == src_real:
        raise ValueError(f"--out {out} is the source checkpoint itself: choose another --out")
    if out_real in src_real.parents:
        raise ValueError(f"--out {out} contains the source checkpoint {source}: replacing it would delete the source; "
                         "choose another --out")
    if src_real in out_real.parents:
        raise ValueError(f"--out {out} is inside the source checkpoint {source}: choose an --out outside it")
    if not out.exists():
        return
    if not overwrite:
        fix = ("pass --overwrite to replace it, or choose another --out" if has_overwrite_flag
               else "choose another --out or remove it")
        raise FileExistsError(f"{out} already exists: {fix}")
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory: --overwrite replaces only a directory")
    entries = sorted(p.name for p in out.iterdir())
    if entries and not any((out / marker).is_file() for marker in _MODEL_MARKERS):
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ValueError(f"--out {out} holds files that are not a checkpoint ({shown}): --overwrite replaces only an "
                         f"earlier output ({', '.join(_MODEL_MARKERS)}); choose another --out")


def _fsync_dir(directory: Path) -> None:
    """Make the directory's entries durable before it is renamed into place."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        self._headers: dict[Path, tuple[dict[str, Any], int]] = {}
        self._manifest = manifest or {}

    def names(self) -> list[str]:
        """All tensor names, in file order."""
        return list(self._files)

    def __contains__(self, name: object) -> bool:
        return name in self._files

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self._files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of a tensor, from its file's header alone."""
        path = self._files[name]
        return tuple(self.header(path)[0][name]["shape"])

    def header(self, path: Path) -> tuple[dict[str, Any], int]:
        """The parsed header of one file (cached); errors name the file."""
        if path not in self._headers:
            if not path.is_file():
                raise CheckpointError(f"{path}: shard file is missing")
            try:
                self._headers[path] = read_header(path)
            except SafetensorsFormatError as exc:
                raise CheckpointError(f"{exc} (truncated or corrupt safetensors file)") from None
        return self._headers[path]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a tensor, from the header alone."""
        header, _ = self.header(self._files[name])
        return CODE_DTYPES[header[name]["dtype"]]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise KeyError(f"tensor {name!r} is not in the checkpoint")
        path = self._files[name]
        header, data_start = self.header(path)
        if name not in header:
            raise CheckpointError(f"{path}: tensor {name!r} is listed in the index but not in the file")
        try:
            tensor = read_tensor(path, name, header[name], data_start)
        except SafetensorsFormatError as exc:
            raise CheckpointError(str(exc)) from None
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
        CheckpointError: no weights, an index naming a missing shard, or a truncated/unreadable file.
    """
    directory = Path(directory)
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
                header, _ = read_header(path)
            except SafetensorsFormatError as exc:
                raise CheckpointError(f"{exc} (truncated or corrupt safetensors file)") from None
            files.update({name: path for name in header if name != "__metadata__"})
    reader = SafetensorsFiles(files, records)
    for path in sorted(set(files.values())):
        reader.header(path)  # fail early, naming the file, on a truncated header or data section
    return reader


def plan_shards(specs: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int) -> list[list]:
    """Group consecutive tensor specs into shards of at most ``max_shard_bytes`` (one oversized tensor alone)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec[1], spec[2])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_sharded(
    directory: Path,
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: Iterator[tuple[str, torch.Tensor]],
    max_shard_bytes: int,
) -> dict[str, dict[str, Any]]:
    """Stream ``tensors`` (in ``specs`` order) into HF-named shards plus an index when there are several.

    Holds one tensor at a time. Returns the manifest records.
    """
    shards = plan_shards(specs, max_shard_bytes)
    count = len(shards)
    names = (["model.safetensors"] if count == 1
             else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)])
    records: dict[str, dict[str, Any]] = {}
    stream = iter(tensors)
    for fname, shard in zip(names, shards):
        writer = StreamingSafetensorsWriter(directory / fname, shard)
        for _ in shard:
            name, tensor = next(stream)
            writer.write(name, tensor)
            records[name] = tensor_record(tensor, fname)
        writer.close()
    leftover = next(stream, None)
    if leftover is not None:
        raise ValueError(f"tensor {leftover[0]!r} was produced but not declared")
    if count > 1:
        total = sum(_nbytes(d, s) for _, d, s in specs)
        index = {"metadata": {"total_size": total}, "weight_map": {n: r["file"] for n, r in records.items()}}
        (directory / HF_INDEX).write_text(json.dumps(index, indent=2))
    return records


def copy_extra_files(src: Path, dst: Path) -> list[str]:
    """Copy generation config and tokenizer files that exist in ``src``; returns their names."""
    copied = []
    for name in HF_EXTRA_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied
