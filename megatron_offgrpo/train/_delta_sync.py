"""``rollout.sync=delta``, the trainer's side: the engine-dtype image of the last version sent, and the choice, each
refresh, between a delta against it and a full sync.

The image lives on global rank 0 (where the export's buckets arrive), on CPU, in the engine's dtype: one copy of the
model (Qwen2.5-0.5B in bf16: 0.99 GB; fp32: 1.98 GB), updated in place tensor by tensor as a refresh is encoded, so
a refresh holds the image plus one export bucket (``rollout.bucket_mb``) and the blobs. Elements compare bitwise in
the engine's dtype: an fp32 update below bf16's resolution is no change now, and is measured against the rounded
value the engine serves next time (it reaches the engine as soon as it crosses a rounding step; nothing drifts).

A full sync (the image itself, which the workers then keep: ``transports.deltas``) is sent at the first refresh of a
process (a start or a resume: the image is not checkpointed), after a refresh that did not complete (the image may
be ahead of the engines), and every ``rollout.full_sync_every`` refreshes; an engine that refuses a delta (it
restarted or joined, serves another version, or a blob failed its checksum) gets the same version whole at once
(``RefreshReport.full_sync``). Every full sync is counted by its reason (``full_syncs``).
"""

from __future__ import annotations

import collections
import time
from typing import Iterable

import torch

from checkpoint_tools import Named, rebucket
from megatron_offgrpo.transports import deltas


class DeltaSender:
    """Encodes each refresh against the last version sent (global rank 0 only).

    Attributes:
        dtype: the engine's dtype (the image's). full_every: a full sync every this many refreshes (>= 1).
        bucket_bytes: the blobs' and the full image's bucket size. full_syncs: reason (``deltas.FullSyncReason``) ->
            count.
    """

    def __init__(self, dtype: torch.dtype, full_every: int, bucket_bytes: int,
                 compression: deltas.Compression = "none") -> None:
        self.dtype, self.full_every, self.bucket_bytes, self.compression = dtype, full_every, bucket_bytes, compression
        self._image: dict[str, torch.Tensor] | None = None
        self._version: int | None = None  # the version the image holds, once the engines verified it
        self._since_full = 0
        self.full_syncs: collections.Counter[deltas.FullSyncReason] = collections.Counter()

    def _full_reason(self) -> deltas.FullSyncReason | None:
        if self._image is None:
            return "first" if not self.full_syncs else "incomplete"
        if self._version is None:
            return "incomplete"
        if self._since_full >= self.full_every:
            return "periodic"
        return None

    def payload(self, buckets: Iterable[Named],
                version: int) -> tuple[deltas.DeltaPayload, deltas.FullSyncReason | None]:
        """The refresh of ``version`` from the export's ``buckets`` (all consumed): (the payload, why it is a full
        sync or None for a delta: "first" of this process, "incomplete" after a refresh that did not complete,
        "periodic": ``rollout.full_sync_every``)."""
        start = time.perf_counter()
        reason = self._full_reason()
        base, self._version = self._version, None  # until ``pushed``: a refresh that fails leaves no base
        image = {} if reason else self._image
        stats = deltas.DeltaStats()
        blobs: Named = []
        for bucket in buckets:
            for name, tensor in bucket:
                new = tensor.detach().to("cpu", self.dtype).contiguous()
                if new.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                    new = new.clone()  # never alias the trainer's own tensor (detach() is a new object, same storage)
                stats.elements += new.numel()
                stats.full_bytes += new.numel() * new.element_size()
                if reason is None:
                    blob, changed = deltas.encode(name, new, image.get(name), base, self.compression)
                    stats.changed += changed
                    stats.bytes += blob.numel()
                    blobs.append((name, blob))
                image[name] = new
        self._image = image
        stats.encode_s = time.perf_counter() - start
        if reason is not None:
            self.full_syncs[reason] += 1
            stats.changed, stats.bytes = stats.elements, stats.full_bytes
        payload = deltas.DeltaPayload(deltas.DeltaSpec(None if reason else base, deltas.dtype_name(self.dtype)),
                                      list(rebucket([blobs], self.bucket_bytes)) if reason is None else self._full(),
                                      self._full, stats)
        return payload, reason

    def _full(self) -> list[Named]:
        return list(rebucket([list(self._image.items())], self.bucket_bytes))

    def pushed(self, version: int, full: bool, refused: dict[str, deltas.FullSyncReason]) -> None:
        """The engines serve and verified ``version`` (``full``: it went whole; ``refused``: engines that refused the
        delta and got it whole)."""
        self._version = version
        self._since_full = 0 if full else self._since_full + 1
        for why in refused.values():
            self.full_syncs[why] += 1
