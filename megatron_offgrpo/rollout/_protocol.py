"""The boundaries of the rollout room: the engine the trainer calls, and the transports behind its refresh."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Protocol, runtime_checkable

from torch import Tensor

from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.rollout._types import ProbeResult, RefreshReport

Buckets = Iterable[list[tuple[str, Tensor]]]
"""HF-named tensors in buckets, as ``checkpoint_tools.stream_hf_buckets`` yields them."""


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates completions with versioned weights; the only thing the trainer knows about generation."""

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[Sample]:
        """Return ``len(prompts) * n`` samples, grouped: samples ``[i*n, (i+1)*n)`` have ``group_id == i``.

        Each group comes from one engine/server and one weight version (``Sample.policy_version``, as reported
        by the engine that generated it).
        """
        ...

    def update_weights(self, weights: Buckets | Path, version: int) -> RefreshReport:
        """Install ``version``: HF-named buckets, or a directory written by ``write_version_dir``."""
        ...

    def version(self) -> int:
        """The version every serving engine holds."""
        ...

    def close(self) -> None:
        """Release servers/processes the engine owns."""
        ...


@runtime_checkable
class ProbeEngine(Protocol):
    """An engine that can score a fixed token sequence (what ``verify_refresh`` needs)."""

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, ProbeResult]:
        """Per server: the version it serves and log p(token_ids[t] | token_ids[:t]) for t = 1..T-1 ([T-1] floats)."""
        ...


class WorkerTarget(Protocol):
    """One engine whose workers run ``OffgrpoWorkerExtension`` (a fleet server, or an in-process vllm.LLM)."""

    name: str

    def rpc(self, method: str, kwargs: dict[str, Any], timeout: float) -> list[Any]:
        """Call ``method`` on every worker of the engine; one result per worker."""
        ...


class WeightTransport(Protocol):
    """Moves one version's weights into the workers of some targets (one class per transport).

    ``prepare`` runs while the targets still serve the previous version (e.g. the disk transport writes the
    version directory then); the engine then pauses the targets, calls ``install``, and resumes them.
    """

    name: str

    def prepare(self, weights: Buckets | Path, version: int) -> Any:
        """Stage ``version`` (write files, or wrap the lazy bucket stream); returns what ``install`` takes."""
        ...

    def install(self, targets: list[WorkerTarget], prepared: Any, version: int) -> dict[str, dict[str, Any]]:
        """Deliver and install ``version`` on every target's workers; per target: {"ok", "error"?, timings}.

        A target whose workers reject the weights (checksum, version, names, shapes) keeps its previous weights.
        """
        ...

    def close(self) -> None:
        """Release groups, files or sockets the transport holds."""
        ...
