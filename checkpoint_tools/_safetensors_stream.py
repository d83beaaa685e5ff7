"""Streaming safetensors files: write a header first, then tensors one at a time; read a tensor by offset.

Why not ``safetensors.torch.save_file``: it needs every tensor of a file in memory at once. A conversion knows
each file's names, dtypes and shapes before it has the data, so the header can be written first and the tensors
appended as they are produced: memory stays at one tensor, whatever the model size. Reading with ``readinto``
(not mmap) keeps the source out of the process's RSS and lets truncation be detected per tensor, with the file
and tensor named. Files written here are standard safetensors (readable by ``safe_open`` / ``from_pretrained``).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Sequence

import torch

DTYPE_CODES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class SafetensorsFormatError(ValueError):
    """A safetensors file whose header or data section is truncated or malformed."""


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * torch.empty((), dtype=dtype).element_size()


class StreamingSafetensorsWriter:
    """Write one safetensors file whose tensors are declared up front and appended in that order."""

    def __init__(
        self,
        path: Path,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Args: path: file to create. specs: (name, dtype, shape) in the order tensors will be written."""
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._expected = []
        for name, dtype, shape in specs:
            size = _nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._expected.append((name, dtype, tuple(shape)))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned, as safetensors writes it
        self.path = path
        self._file = open(path, "wb", buffering=0)
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next declared tensor (name, dtype and shape must match the declaration)."""
        exp_name, exp_dtype, exp_shape = self._expected[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (exp_name, exp_dtype, exp_shape):
            raise ValueError(f"{self.path}: expected {exp_name} {exp_dtype} {exp_shape}, "
                             f"got {name} {tensor.dtype} {tuple(tensor.shape)}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        while view.nbytes:
            written = self._file.write(view)
            view = view[written:]
        self._next += 1

    def close(self) -> None:
        """Check every declared tensor was written, then flush to disk (fsync) so a later rename is durable."""
        try:
            if self._next != len(self._expected):
                raise ValueError(f"{self.path}: only {self._next} of {len(self._expected)} declared tensors written")
            os.fsync(self._file.fileno())
        finally:
            self._file.close()


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a safetensors file and the byte offset of its data section.

    Raises:
        SafetensorsFormatError: naming the file when the header is truncated, malformed, or the data section is
            shorter than the header declares.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{path}: truncated safetensors file (no header)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100 * 1024**2:
            raise SafetensorsFormatError(f"{path}: truncated or corrupt safetensors header "
                                         f"({length} bytes declared, file has {size})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SafetensorsFormatError(f"{path}: corrupt safetensors header ({exc})") from None
    data_start = 8 + length
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if data_start + end > size:
        raise SafetensorsFormatError(
            f"{path}: truncated safetensors file: data section needs {end} bytes, file has {size - data_start}"
        )
    return header, data_start


def read_tensor(path: Path, name: str, entry: dict[str, Any], data_start: int) -> torch.Tensor:
    """Read one tensor with ``readinto`` into a fresh buffer (no mmap)."""
    begin, end = entry["data_offsets"]
    try:
        dtype = CODE_DTYPES[entry["dtype"]]
    except KeyError:
        raise SafetensorsFormatError(f"{path}: tensor {name!r} has unsupported dtype {entry['dtype']}") from None
    if end - begin != _nbytes(dtype, entry["shape"]):
        raise SafetensorsFormatError(f"{path}: tensor {name!r}: offsets do not match shape {entry['shape']}")
    buffer = torch.empty(end - begin, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start + begin)
        view = memoryview(buffer.numpy())
        while view.nbytes:
            got = f.readinto(view)
            if not got:
                raise SafetensorsFormatError(f"{path}: truncated while reading tensor {name!r}")
            view = view[got:]
    return buffer.view(dtype).reshape(entry["shape"])
