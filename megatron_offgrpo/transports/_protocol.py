"""The boundary of the transports room: what a transport talks to, what it does, and what it measured."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterable, Literal, Protocol

from torch import Tensor

from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._worker_calls import WORKER_EXTENSION, WorkerRequest  # noqa: F401 (re-exported)

Buckets = Iterable[list[tuple[str, Tensor]]]
"""HF-named tensors in buckets, as ``checkpoint_tools.stream_hf_buckets`` yields them."""

DIRTY = -1
"""The version a worker reports after a reload failed midway: its weights are undefined until a full refresh."""



PayloadKind = Literal["full", "adapter", "delta"]
"""What a refresh moved: the whole model, the policy's LoRA adapter (``transports.adapters.AdapterPayload``), or the
changed elements of the whole model (``transports.deltas.DeltaPayload``)."""


@dataclasses.dataclass
class TransferMetrics:
    """What the trainer's side of one transfer measured (``WeightTransport.metrics`` after ``install``).

    Attributes:
        seconds: phase -> wall seconds on the trainer (e.g. "write", "join", "send", "call").
        bytes: payload bytes written or sent. tensors: tensors moved. buckets: files or messages used.
        kind: the payload moved.
    """

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    kind: PayloadKind = "full"


class WorkerTarget(Protocol):
    """One engine whose workers run ``OffgrpoWorkerExtension`` (a fleet server, or an in-process vllm.LLM)."""

    name: str

    def call(self, request: WorkerRequest, timeout: float) -> list[object]:
        """Call ``request``'s method on every worker of the engine; one wire answer per worker
        (``WorkerAnswer.from_wire``)."""
        ...


class WeightTransport(Protocol):
    """Moves one version's weights into the workers of some targets (one class per transport).

    ``prepare`` runs while the targets still serve the previous version (e.g. the disk transport writes the
    version directory then); the engine then pauses the targets, calls ``install``, resumes them and reads
    ``metrics``.
    """

    name: str

    def prepare(self, weights: Buckets | Path | Any, version: int) -> Any:
        """Stage ``version`` (write files, or wrap the lazy bucket stream); returns what ``install`` takes.
        ``weights`` may be an ``adapters.AdapterPayload``: its buckets travel as a full version's do, and ``install``
        has the workers build the adapter from them."""
        ...

    def install(self, targets: list[WorkerTarget], prepared: Any, version: int) -> dict[str, WorkerAnswer]:
        """Deliver and install ``version`` on every target's workers; per target name: its workers' answer.

        A target whose workers reject the weights (checksum, version, names, shapes) keeps its previous weights.
        """
        ...

    def metrics(self) -> TransferMetrics:
        """What the last ``prepare`` + ``install`` measured on the trainer's side."""
        ...

    def close(self) -> None:
        """Release groups, files or sockets the transport holds."""
        ...
