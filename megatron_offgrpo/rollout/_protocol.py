"""The boundary of the rollout room: the engine the trainer calls."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.rollout._types import ProbeResult, RefreshReport
from megatron_offgrpo.transports import Buckets


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates completions with versioned weights; the only thing the trainer knows about generation.

    Capabilities, which the trainer reads instead of probing the engine:
        concurrent_generate: ``generate`` may be called from several threads at once, their requests sharing one
            batch (a request that ends frees its slot for any caller's next one): the in-process vLLM engine and the
            fleet client (but while they record routing with hooks); ``rollout.mode=async`` then generates several
            steps at once.
        partial_rollouts: a refresh lands between two decode steps of the requests in flight, which go on under the
            new weights (each token keeps its version): vLLM engines built with it.
    """

    concurrent_generate: bool
    partial_rollouts: bool

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
