"""The slow refresh baselines of ``benchmarks/refresh.py``: the per-tensor pattern of peer trainers.

They live here, not in ``megatron_offgrpo.transports``: nothing but the benchmark (and the tests that keep it honest)
sends one message or writes one file per tensor, so the production transports carry no knob for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_offgrpo.transports import CollectiveTransport, DiskTransport


class PerTensorCollectiveTransport(CollectiveTransport):
    """One control round trip and one broadcast per tensor, staged on the workers and installed by a last call.

    The peers' per-tensor *install* is not reproduced: vLLM's in-place reload of part of a fused layer (e.g. q_proj
    alone) corrupts the rest of the layer, so the workers install the staged tensors in one complete reload.
    """

    def __init__(self, **kwargs: Any) -> None:
        """Args: kwargs: ``CollectiveTransport``'s, but ``bucket_bytes`` (0: every tensor is its own bucket)."""
        super().__init__(bucket_bytes=0, **kwargs)

    def _send(self, targets: list, buckets: Any, version: int) -> tuple[dict, dict]:
        total = {"bytes": 0, "buckets": 0, "tensors": 0}
        for bucket in buckets:
            answers, stats = self._stream(targets, [bucket], version, commit=False)
            if not all(a.ok for a in answers.values()):
                return answers, total
            total = {k: total[k] + stats[k] for k in total}
        answers, _ = self._stream(targets, [], version, commit=True)
        return answers, total


def per_tensor_disk(root: str | Path, **kwargs: Any) -> DiskTransport:
    """A disk transport that writes one safetensors file per tensor (``kwargs``: ``DiskTransport``'s)."""
    return DiskTransport(root, bucket_bytes=0, **kwargs)
