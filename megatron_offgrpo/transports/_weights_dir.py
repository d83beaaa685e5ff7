"""Version directories: one HF safetensors directory per weight version, written atomically, read verified.

Layout of ``<root>/v<version:08d>/`` (a standard HF directory that vLLM and ``from_pretrained`` can load):
    model-00001.safetensors ...     one file per bucket (the trainer's streaming export, one bucket in memory)
    model.safetensors.index.json    name -> file
    config.json                     when the writer is given the HF config (makes the directory servable alone)
    offgrpo_manifest.json           written last: every tensor's file, shape, dtype, CRC-32, and the version

The directory appears under its final name only when complete (``checkpoint_tools.files.atomic_output_dir``), so a
server never sees a half-written version; readers check the manifest's version and every tensor's checksum
before anything is loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterable

import torch

from checkpoint_tools import CheckpointError, files, open_safetensors_dir, safetensors_stream

Named = list[tuple[str, torch.Tensor]]
KIND = "offgrpo-refresh"


def version_dir(root: Path, version: int) -> Path:
    """The directory of ``version`` under ``root``."""
    return Path(root) / f"v{int(version):08d}"


def write_version_dir(
    out: Path, buckets: Iterable[Named], version: int, hf_config: dict[str, Any] | None = None, overwrite: bool = False
) -> tuple[Path, dict[str, int]]:
    """Write ``buckets`` as a HF safetensors directory for ``version`` (atomic; one file per bucket).

    Args:
        out: the directory to create (``version_dir(root, version)``).
        buckets: HF-named tensors in buckets (e.g. ``checkpoint_tools.stream_hf_buckets``), consumed lazily.
        version: the weight version; recorded in the manifest and checked by every reader.
        hf_config: written as ``config.json`` when given.
        overwrite: replace an existing ``out`` (only after the new one is complete).

    Returns:
        (out, {"bytes": payload bytes, "tensors": count, "buckets": files}).
    """
    stats = {"bytes": 0, "tensors": 0, "buckets": 0}
    with files.atomic_output_dir(out, overwrite=overwrite) as tmp:
        records: dict[str, dict[str, Any]] = {}
        for bucket in buckets:
            if not bucket:
                continue
            stats["buckets"] += 1
            fname = f"model-{stats['buckets']:05d}.safetensors"
            bucket = [(name, tensor.detach().contiguous().cpu()) for name, tensor in bucket]
            specs = [(n, t.dtype, tuple(t.shape)) for n, t in bucket]
            writer = safetensors_stream.StreamingSafetensorsWriter(tmp / fname, specs)
            for name, tensor in bucket:
                if name in records:
                    raise ValueError(
                        f"tensor {name!r} appears twice in the weights of version {version}: each tensor once"
                    )
                writer.write(name, tensor)
                records[name] = files.tensor_record(tensor, fname)
                stats["bytes"] += tensor.numel() * tensor.element_size()
            writer.close()
        if not records:
            raise ValueError(f"version {version}: the weights iterable yielded no tensors")
        stats["tensors"] = len(records)
        index = {"metadata": {"total_size": stats["bytes"]}, "weight_map": {n: r["file"] for n, r in records.items()}}
        (tmp / files.HF_INDEX).write_text(json.dumps(index, indent=1))
        if hf_config is not None:
            (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        files.write_manifest(tmp, KIND, records, {"version": int(version)})
    return Path(out), stats


def manifest_version(directory: Path) -> int | None:
    """The version recorded in a directory's manifest (None without a manifest or a version)."""
    manifest = files.read_manifest(Path(directory))
    if manifest is None:
        return None
    version = manifest.get("meta", {}).get("version")
    return None if version is None else int(version)


def read_version_dir(directory: Path, version: int) -> Named:
    """Read every tensor of a version directory, each checked against the manifest (shape and CRC-32).

    Raises:
        CheckpointError: no manifest, a manifest for another version, a missing/truncated file or a checksum
            mismatch; nothing is returned, so the caller's weights stay as they were.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such version directory (is the path shared with the server?)")
    manifest = files.read_manifest(directory)
    if manifest is None:
        raise CheckpointError(
            f"{directory}: no offgrpo_manifest.json: not a complete refresh directory (write it with write_version_dir)"
        )
    found = manifest.get("meta", {}).get("version")
    if found is None or int(found) != int(version):
        raise CheckpointError(
            f"{directory}: manifest is for version {found}, the refresh asked for version {version}: wrong directory"
        )
    reader = open_safetensors_dir(directory)
    missing = sorted(set(manifest["tensors"]) - set(reader.names()))
    if missing:
        raise CheckpointError(f"{directory}: tensors {missing[:3]} are in the manifest but in no file")
    return [(name, reader[name]) for name in manifest["tensors"]]


def prune_versions(root: Path, keep: int, protect: Iterable[int] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` version directories under ``root`` (never those in ``protect``)."""
    protected = {version_dir(root, v).name for v in protect}
    dirs = sorted(p for p in Path(root).glob("v" + "[0-9]" * 8) if p.is_dir())
    removed = [p for p in dirs[: max(0, len(dirs) - keep)] if p.name not in protected]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
