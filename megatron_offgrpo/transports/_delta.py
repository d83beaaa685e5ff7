"""Delta payloads: a refresh that carries, per HF tensor, only the elements whose engine-dtype value changed.

With ``rollout.sync=delta`` the trainer (global rank 0) keeps the engine-dtype image of the last version it sent and
sends, for every tensor of the model, one ``uint8`` blob (named as the tensor, carried in buckets by every transport
as a full version's tensors are) holding::

    header (HEADER: magic, positions format, compression, checksum kind, dtype code, checksum of the tensor's full new
            value, numel, changed count, the base version it applies onto)
    body   (optionally zlib'd): the changed positions (gaps as uint16 when every gap fits, else uint32, or a bitmask
            when that is smaller), then the changed elements' new values (raw engine-dtype bytes)

Overwrite encoding (new values, not xor): applying a blob twice gives the same tensor, so a retried refresh can never
double-apply. Elements compare bitwise (integer views), so -0.0 vs 0.0 and every bf16 rounding step count as
changes: a change below the engine dtype's resolution is no change (nothing is lost: the trainer's image holds the
rounded value the engine serves, and the next change is measured against it).

A blob applies only onto ``base`` (``apply``): wrong base, wrong size or dtype, a corrupt header or body, values
that are not finite, or a patched tensor whose checksum is not the one the trainer computed are refused (``Refused``,
one line naming the tensor and version), before anything is served. ``DeltaSpec`` is what the worker call carries
(base version and dtype); ``DeltaPayload`` is what the trainer hands the engine (the blobs, and the full version the
engine falls back to).

Checksums: xxh3-64 when ``xxhash`` is installed on both sides (12 GB/s measured on this machine's core, ~0.08 s per
GB), else CRC-32 (``zlib.crc32``, 1.7 GB/s: ~0.6 s per GB); the header names the kind, a worker without it refuses.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from typing import TYPE_CHECKING, Any, Callable, Literal, get_args

import numpy as np
import torch

if TYPE_CHECKING:  # the worker calls import this module, and the protocol imports them
    from megatron_offgrpo.transports._protocol import Buckets

try:  # an optional accelerator: 7x faster than CRC-32
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

HEADER = struct.Struct("<4sBBBBIQQQq")
"""magic, positions format (GAPS/GAPS16/BITMASK), compression (NONE/ZLIB), checksum kind (CRC32/XXH3), dtype code,
padding, checksum, numel, changed count, base version (40 bytes)."""
MAGIC = b"ODL1"
GAPS, BITMASK, GAPS16 = 0, 1, 2
NONE, ZLIB = 0, 1
CRC32, XXH3 = 0, 1
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_EXPONENT = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
"""The exponent bits of each dtype: all set is an infinity or a NaN."""
Compression = Literal["zlib", "none"]


RefusalKind = Literal["no image", "base", "dtype", "tensors", "corrupt", "checksum"]
"""Why an engine refused a delta (a worker answer's ``full_sync_needed``): it holds no image (restarted, joined),
the delta is made from another version, for another dtype, not for exactly its tensors, corrupt (bad header or body,
values not finite), or a patched tensor fails its checksum."""
FullSyncReason = Literal["first", "incomplete", "periodic", "refused: no image", "refused: base", "refused: dtype",
                         "refused: tensors", "refused: corrupt", "refused: checksum", "refused: failed"]
"""Why a full sync was sent in delta mode (counted by ``train.DeltaSender``): the first refresh of a process, after
an incomplete one, every ``rollout.full_sync_every``, or an engine refused the delta (its ``RefusalKind``; "failed":
its load failed otherwise)."""


class Refused(ValueError):
    """A blob that must not be applied: the engine keeps its version and gets a full sync. ``kind``: why, typed."""

    def __init__(self, message: str, kind: RefusalKind = "corrupt") -> None:
        super().__init__(message)
        self.kind: RefusalKind = kind


def refusal(kind: str | None) -> FullSyncReason:
    """The counted reason of an engine that did not take a delta, from its answer's ``full_sync_needed``."""
    reason = f"refused: {kind}"
    return reason if reason in get_args(FullSyncReason) else "refused: failed"  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class DeltaSpec:
    """What a worker call says of a delta-mode refresh: it applies onto ``base`` (the version it was made from), the
    trainer's image being in ``dtype`` (the engine's: "float32" or "bfloat16"). ``base`` None: a full version (in
    ``dtype``) whose image the worker keeps, for the deltas that follow."""

    base: int | None
    dtype: str

    def to_wire(self) -> dict[str, Any]:
        """The JSON object a worker call carries."""
        return {"base": self.base, "dtype": self.dtype}


def spec_of(value: DeltaSpec | dict[str, Any] | None) -> DeltaSpec | None:
    """A ``DeltaSpec`` from itself or its wire form (a worker call's field)."""
    return DeltaSpec(**value) if isinstance(value, dict) else value


@dataclasses.dataclass
class DeltaStats:
    """What encoding one refresh measured: elements changed of all, blob bytes, seconds, the full size."""

    changed: int = 0
    elements: int = 0
    bytes: int = 0
    full_bytes: int = 0
    encode_s: float = 0.0

    @property
    def changed_fraction(self) -> float:
        """Changed elements over all elements (0 with none)."""
        return self.changed / self.elements if self.elements else 0.0


@dataclasses.dataclass
class DeltaPayload:
    """One version as a delta, as the trainer hands it to ``RolloutEngine.update_weights``.

    Attributes:
        spec: the base version and dtype. buckets: one blob per HF tensor (``encode``), every tensor of the model.
        full: the same version whole (the trainer's image, engine dtype), for the engines that refuse the delta.
        stats: what encoding measured.
    """

    spec: DeltaSpec
    buckets: Buckets
    full: Callable[[], Buckets]
    stats: DeltaStats = dataclasses.field(default_factory=DeltaStats)

    def as_full(self) -> DeltaPayload:
        """The same version whole, in delta mode (the workers keep its image): what an engine that refused the delta
        gets instead."""
        return DeltaPayload(DeltaSpec(None, self.spec.dtype), self.full(), self.full, self.stats)

    def summary(self) -> dict[str, float]:
        """The encoding's figures for a refresh report's detail."""
        return {"changed_fraction": self.stats.changed_fraction, "encode_s": self.stats.encode_s,
                "full_bytes": float(self.stats.full_bytes)}


def split_payload(weights: Any) -> tuple[Any, DeltaSpec | None]:
    """(what a transport moves, the delta it is or None)."""
    if isinstance(weights, DeltaPayload):
        return weights.buckets, weights.spec
    return weights, None


def kind_of(adapter: Any, delta: DeltaSpec | None) -> Literal["full", "adapter", "delta"]:
    """What a refresh moves: an adapter, a delta onto a base, or the whole model."""
    if adapter is not None:
        return "adapter"
    return "delta" if delta is not None and delta.base is not None else "full"


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def checksum(tensor: torch.Tensor, kind: int | None = None) -> tuple[int, int]:
    """(kind, checksum of ``tensor``'s bytes): xxh3-64 when installed (or asked), else CRC-32."""
    kind = (XXH3 if xxhash is not None else CRC32) if kind is None else kind
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    if kind == XXH3:
        if xxhash is None:
            raise Refused("the checksum is xxh3-64 and this process has no xxhash module (pip install xxhash)",
                          "checksum")
        return kind, xxhash.xxh3_64_intdigest(data)
    return CRC32, zlib.crc32(data)


def all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or infinity in ``tensor`` (fp32, bf16 or fp16), read from the exponent bits: an integer pass, 5x
    faster than ``torch.isfinite`` on bf16 here."""
    exponent = _EXPONENT[tensor.dtype]
    return not bool(((_bits(tensor) & exponent) == exponent).any())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(_INT_VIEW[tensor.element_size()])


def encode(name: str, new: torch.Tensor, old: torch.Tensor | None, base: int,
           compression: Compression = "none") -> tuple[torch.Tensor, int]:
    """The blob that patches ``old`` (version ``base``, or None: all changed) into ``new``; (blob, changed count).

    Raises:
        ValueError: ``new`` holds NaN or infinity (naming the tensor), a dtype other than fp32/bf16/fp16, a shape or
            dtype other than ``old``'s.
    """
    if new.dtype not in DTYPE_CODES:
        raise ValueError(f"delta of {name!r}: dtype {new.dtype} is not one of {sorted(map(str, DTYPE_CODES))}")
    if old is not None and (old.shape != new.shape or old.dtype != new.dtype):
        raise ValueError(f"delta of {name!r}: {list(new.shape)} {new.dtype} onto {list(old.shape)} {old.dtype}")
    flat = new.detach().contiguous().reshape(-1)
    if flat.numel() >= 2**32:
        raise ValueError(f"delta of {name!r}: {flat.numel()} elements, positions are 32-bit")
    changed = (_bits(flat) != _bits(old)) if old is not None else torch.ones(flat.numel(), dtype=torch.bool)
    count = int(torch.count_nonzero(changed))
    mask_bytes = (flat.numel() + 7) // 8
    if 2 * count <= mask_bytes:  # sparse: the gaps between positions (int64 positions of at most numel / 16 changes)
        positions = torch.nonzero(changed).reshape(-1)
        values = flat[positions]
        gaps = np.diff(positions.numpy(), prepend=0)
        width = 2 if not count or gaps.max() < 2**16 else 4
        fmt = GAPS16 if width == 2 else GAPS
        where = gaps.astype("<u2" if width == 2 else "<u4").tobytes()
        if width * count > mask_bytes:
            fmt, where = BITMASK, np.packbits(changed.numpy(), bitorder="little").tobytes()
    else:  # dense: a bitmask (numel / 8 bytes), the values gathered by it, no positions ever held
        values = flat[changed]
        fmt, where = BITMASK, np.packbits(changed.numpy(), bitorder="little").tobytes()
    if not all_finite(values):  # the rest equals the image, checked when it was sent
        raise ValueError(f"delta of {name!r}: the new value holds NaN or infinity: refusing to send it")
    body = where + values.view(torch.uint8).numpy().tobytes()
    comp = ZLIB if compression == "zlib" else NONE
    if comp == ZLIB:
        body = zlib.compress(body, 1)  # level 1: the gaps compress, the values barely: speed over ratio
    kind, check = checksum(flat)
    header = HEADER.pack(MAGIC, fmt, comp, kind, DTYPE_CODES[new.dtype], 0, check, flat.numel(), count, int(base))
    return torch.frombuffer(bytearray(header + body), dtype=torch.uint8), count


def read_header(blob: torch.Tensor) -> dict[str, int]:
    """A blob's header fields (``HEADER``); ``Refused`` for a blob too short or not a delta."""
    raw = blob.contiguous().numpy().tobytes()[:HEADER.size] if blob.numel() >= HEADER.size else b""
    if len(raw) < HEADER.size or raw[:4] != MAGIC:
        raise Refused("not a delta blob (bad magic or too short)")
    _, fmt, comp, kind, dtype, _, check, numel, count, base = HEADER.unpack(raw)
    return {"fmt": fmt, "comp": comp, "kind": kind, "dtype": dtype, "checksum": check, "numel": numel,
            "changed": count, "base": base}


def apply(name: str, blob: torch.Tensor, image: torch.Tensor, base: int) -> torch.Tensor | None:
    """``image`` (version ``base``) patched by ``blob``: a new tensor, or None when the blob changes nothing (its
    checksum still checked against ``image``). ``image`` is never written.

    Raises:
        Refused: as ``apply_in_place``.
    """
    out = image.detach().clone()
    return None if apply_in_place(name, blob, out, base) is None else out


def apply_in_place(name: str, blob: torch.Tensor, image: torch.Tensor, base: int) -> Callable[[], None] | None:
    """Patch ``image`` (contiguous, version ``base``) by ``blob`` in place, then check the patched tensor's checksum:
    no copy of the tensor, only of the elements the blob sets. Returns the undo (it writes the old elements back), or
    None when the blob changes nothing.

    Raises:
        Refused: a blob made from another version, for another size or dtype, corrupt, with values that are not
            finite, or whose patched tensor fails its checksum (one line naming the tensor); ``image`` is then as it
            was.
    """
    try:
        head = read_header(blob)
    except Refused as exc:
        raise Refused(f"{name}: {exc}", exc.kind) from None
    if head["base"] != int(base):
        raise Refused(f"{name}: the delta applies onto version {head['base']}, this engine serves version {base}",
                      "base")
    if head["numel"] != image.numel() or CODE_DTYPES.get(head["dtype"]) != image.dtype:
        raise Refused(f"{name}: the delta is for {head['numel']} elements of dtype code {head['dtype']}, the served "
                      f"tensor has {image.numel()} of {image.dtype}", "tensors")
    undo = None
    if head["changed"]:
        where, values = _decoded(name, blob, image, head)
        flat = image.view(-1)
        old = flat[where]  # advanced indexing: a copy of the elements about to change

        def undo() -> None:
            flat[where] = old

        flat[where] = values
    if checksum(image, head["kind"])[1] != head["checksum"]:
        if undo is not None:
            undo()
        raise Refused(f"{name}: checksum mismatch after patching version {base}: the delta is corrupt or its base "
                      "differs from the served weights", "checksum")
    return undo


def _decoded(name: str, blob: torch.Tensor, image: torch.Tensor,
             head: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(where, values): the positions ``blob`` sets (int64 positions, or a bool mask for a bitmask blob: either
    indexes the flat tensor) and their values, checked (sizes, bounds, finite values)."""
    body = blob.contiguous().numpy().tobytes()[HEADER.size:]
    try:
        if head["comp"] == ZLIB:
            body = zlib.decompress(body)
        numel, count, size = head["numel"], head["changed"], image.element_size()
        if head["fmt"] in (GAPS, GAPS16):
            width = 4 if head["fmt"] == GAPS else 2
            split = width * count
            where = torch.from_numpy(np.cumsum(np.frombuffer(body[:split], dtype=f"<u{width}").astype(np.int64)))
            if count and (int(where[-1]) >= numel or int(where.min()) < 0):
                raise ValueError("a position past the tensor's end")
            located = where.numel()
        else:  # a bool mask of numel elements: 1 byte each, where int64 positions of a dense delta would take 8
            split = (numel + 7) // 8
            bits = np.frombuffer(body[:split], dtype=np.uint8)
            where = torch.from_numpy(np.unpackbits(bits, count=numel, bitorder="little").view(np.bool_))
            located = int(torch.count_nonzero(where)) if len(bits) == split else -1
        values = torch.frombuffer(bytearray(body[split:split + count * size]), dtype=image.dtype)
        if located != count or values.numel() != count or len(body) != split + count * size:
            raise ValueError(f"{count} changes announced, {located} positions and {values.numel()} values")
    except (zlib.error, ValueError) as exc:
        raise Refused(f"{name}: corrupt delta body: {exc}") from None
    if not all_finite(values):
        raise Refused(f"{name}: the delta's values hold NaN or infinity")
    return where, values
