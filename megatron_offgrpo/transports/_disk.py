"""The disk transport: the trainer writes version k into a shared directory; each server reloads from the path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from checkpoint_tools import rebucket
from megatron_offgrpo.transports import _delta as deltas
from megatron_offgrpo.transports._adapter import AdapterSpec, split_payload
from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._protocol import Buckets, TransferMetrics, WorkerTarget
from megatron_offgrpo.transports._rpc import call_targets
from megatron_offgrpo.transports._weights_dir import manifest_version, prune_versions, version_dir, write_version_dir
from megatron_offgrpo.transports._worker_calls import LoadDir


class DiskTransport:
    """Write ``<root>/v<k>`` (HF safetensors, atomic, manifest with CRCs and version), then ``offgrpo_load_dir``.

    Attributes:
        root: the shared directory (every server must see the same path).
        keep: version directories kept on disk (older ones are pruned after a successful refresh).
        bucket_bytes: regroup the incoming buckets into files of at least this size (None: one file per incoming
            bucket; 0: one file per tensor).
        hf_config: written as each version's config.json when given (the directory can then be served alone).
        timeout_s: bound on one server's load.
    """

    name = "disk"

    def __init__(
        self,
        root: str | Path,
        keep: int = 2,
        bucket_bytes: int | None = None,
        hf_config: dict[str, Any] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if keep < 1:
            raise ValueError(f"DiskTransport keep={keep}: keep at least the served version (keep >= 1)")
        self.root = Path(root)
        self.keep, self.bucket_bytes, self.hf_config, self.timeout_s = keep, bucket_bytes, hf_config, timeout_s
        self._metrics = TransferMetrics()
        self._adapter: AdapterSpec | None = None  # what the prepared version is: an adapter, or the whole model
        self._delta: deltas.DeltaSpec | None = None  # ... or a delta (or a full version in delta mode)

    def prepare(self, weights: Buckets | Path | Any, version: int) -> Path:
        """Write the version directory (or check a given one's manifest version); returns its path."""
        start = time.perf_counter()
        weights, self._adapter = split_payload(weights)
        weights, self._delta = deltas.split_payload(weights)
        if isinstance(weights, (str, Path)):
            path = Path(weights).resolve()
            found = manifest_version(path) if path.is_dir() else None
            if found != version:
                raise ValueError(
                    f"weights={path}: its manifest is for version {found}, update_weights was called with "
                    f"version={version}: write it with write_version_dir(path, buckets, {version})"
                )
            self._metrics = TransferMetrics({"write": 0.0})
            return path
        buckets = rebucket(weights, self.bucket_bytes) if self.bucket_bytes is not None else weights
        path, stats = write_version_dir(
            version_dir(self.root, version), buckets, version, self.hf_config, overwrite=True
        )
        kind = deltas.kind_of(self._adapter, self._delta)
        self._metrics = TransferMetrics({"write": time.perf_counter() - start}, **stats, kind=kind)
        return path.resolve()

    def install(self, targets: list[WorkerTarget], prepared: Path, version: int) -> dict[str, WorkerAnswer]:
        """Every target's workers check and load ``prepared`` concurrently."""
        answers, _ = call_targets(
            targets,
            lambda i, t: LoadDir(path=str(prepared), version=int(version), adapter=self._adapter,
                                 delta=self._delta),
            self.timeout_s,
        )
        if any(a.ok for a in answers.values()) and prepared.parent == self.root.resolve():
            prune_versions(self.root, self.keep, protect=[version])
        return answers

    def metrics(self) -> TransferMetrics:
        """The last refresh's write time and size (bytes, tensors, files)."""
        return self._metrics

    def close(self) -> None:
        """Nothing to release (version directories stay for inspection; ``keep`` bounds them)."""
