"""HF-named tensors on the wire: the expected set of a model, and buckets packed into one contiguous buffer.

A refresh must install every tensor of the model with its exact shape: a missing tensor would leave stale
weights serving unnoticed (the failure after a PP reshard), and vLLM's in-place reload cannot be rolled back
once it starts. So every transport checks the complete name/shape set *before* anything is loaded.

A bucket travels as one flat ``uint8`` buffer plus a small JSON header (names, dtypes, shapes, byte offsets):
one broadcast (or one shared-memory file) per bucket instead of one per tensor. The buffer is always one
contiguous tensor (gloo sends the wrong bytes from non-contiguous views).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import torch

from checkpoint_tools import Named, rebucket, safetensors_stream
from megatron_offgrpo.transports._weights_dir import read_version_dir

DEFAULT_BUCKET_BYTES = 256 * 1024**2


def check_complete(
    shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str = "model"
) -> None:
    """Raise ``ValueError`` unless ``shapes`` has exactly the expected names, each with the expected shape.

    Args:
        shapes: name -> shape of the tensors a refresh carries.
        expected: name -> shape of the served model (``expected_hf_shapes``) or adapter.
        what: "model" or "adapter", for the message.
    """
    problems = []
    missing = [n for n in expected if n not in shapes]
    unknown = [n for n in shapes if n not in expected]
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing (e.g. {missing[:3]}): a refresh must carry the whole {what}")
    if unknown:
        problems.append(f"{len(unknown)} unknown tensor name(s) (e.g. {unknown[:3]}): not a tensor of the served "
                        f"{what}")
    wrong = [(n, tuple(s), expected[n]) for n, s in shapes.items() if n in expected and tuple(s) != tuple(expected[n])]
    for name, got, want in wrong[:5]:
        problems.append(f"tensor {name!r} has shape {list(got)}, the served {what} needs {list(want)}")
    if problems:
        raise ValueError("refresh rejected before loading: " + "; ".join(problems))


def bucket_stream(weights: Any, version: int, bucket_bytes: int) -> Iterator[Named]:
    """``weights`` regrouped into buckets of >= ``bucket_bytes`` (lazily); a version directory is read first."""
    if isinstance(weights, (str, bytes)) or hasattr(weights, "is_dir"):
        weights = [read_version_dir(weights, version)]
    return rebucket(weights, bucket_bytes)


def bucket_layout(bucket: Named) -> tuple[list[dict[str, Any]], int]:
    """Where each tensor of ``bucket`` sits in its packed buffer: (entries, total bytes).

    Each entry holds the tensor's name, safetensors dtype code, shape and ``[begin, end)`` byte offsets.
    """
    entries, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(
            {
                "name": name,
                "dtype": safetensors_stream.DTYPE_CODES[tensor.dtype],
                "shape": list(tensor.shape),
                "offsets": [offset, offset + nbytes],
            }
        )
        offset += nbytes
    return entries, offset


def pack_into(bucket: Named, entries: list[dict[str, Any]], buffer: torch.Tensor) -> None:
    """Copy each tensor of ``bucket`` to its ``[begin, end)`` bytes of ``buffer`` (``uint8``; see ``bucket_layout``)."""
    for (_, tensor), entry in zip(bucket, entries):
        begin, end = entry["offsets"]
        if end > begin:
            buffer[begin:end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))


def pack_bucket(bucket: Named) -> tuple[bytes, torch.Tensor]:
    """Flatten a bucket into (JSON header, one fresh contiguous ``uint8`` buffer [total bytes])."""
    entries, total = bucket_layout(bucket)
    buffer = torch.empty(total, dtype=torch.uint8)
    pack_into(bucket, entries, buffer)
    return json.dumps({"tensors": entries}).encode(), buffer


def unpack_bucket(header: bytes, buffer: torch.Tensor) -> Named:
    """Inverse of ``pack_bucket``: views into ``buffer`` (which the caller owns), one per tensor."""
    return unpack_entries(json.loads(header)["tensors"], buffer)


def unpack_entries(entries: list[dict[str, Any]], buffer: torch.Tensor) -> Named:
    """Views into ``buffer``, one per ``bucket_layout`` entry."""
    out = []
    for entry in entries:
        begin, end = entry["offsets"]
        dtype = safetensors_stream.CODE_DTYPES[entry["dtype"]]
        out.append((entry["name"], buffer[begin:end].view(dtype).reshape(entry["shape"])))
    return out
