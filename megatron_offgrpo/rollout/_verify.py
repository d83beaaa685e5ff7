"""Post-refresh verification: the fleet's log-probs of a fixed probe sequence must equal the trainer's.

A refresh that silently did not happen, a transposed or stale tensor, or a mis-resharded stage all move the
probe's log-probs far beyond the per-dtype tolerance (``PROBE_ATOL``), on the server that holds them.
"""

from __future__ import annotations

import logging
import math

import torch

from megatron_offgrpo.rollout._errors import RefreshVerificationError
from megatron_offgrpo.rollout._protocol import ProbeEngine

logger = logging.getLogger(__name__)


def make_probe_ids(vocab_size: int, length: int = 32, seed: int = 1234) -> list[int]:
    """The probe: a fixed pseudo-random sequence of ``length`` token ids below ``vocab_size`` (same on every call).

    The one builder of the probe sequence: the trainer's refresh check (``train._sync.verify``), the refresh benchmark
    and the tests all take it from here.
    """
    if length < 2:
        raise ValueError(f"probe length={length}: needs at least 2 tokens (one log-prob per token after the first)")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def verify_refresh(
    engine: ProbeEngine, probe_ids: list[int], expected_logprobs: list[float], version: int, atol: float
) -> dict[str, float]:
    """Check every serving engine/server scores ``probe_ids`` like the trainer, at ``version``.

    Args:
        engine: a rollout engine with ``probe_logprobs`` (all engines of this package have it).
        probe_ids: [T] the probe token ids. expected_logprobs: [T-1] the trainer's log p(probe[t] | probe[:t]),
            t = 1..T-1, from the weights of ``version`` at temperature 1 (vLLM's prompt log-probs are never
            temperature-scaled, whatever the sampling temperature or logprobs mode).
            atol: max allowed |delta| per token (``probe_atol(dtype)``).

    Returns:
        server name -> max |delta log-prob| (for logs).

    Raises:
        ValueError: ``expected_logprobs`` is not [T-1] long.
        RefreshVerificationError: naming the version and each server that serves another version or differs by
            more than ``atol`` (or gives NaN).
    """
    if len(expected_logprobs) != len(probe_ids) - 1:
        raise ValueError(
            f"expected_logprobs has {len(expected_logprobs)} values for {len(probe_ids)} probe ids: "
            f"give one log-prob per probe token after the first ({len(probe_ids) - 1})"
        )
    results = engine.probe_logprobs(probe_ids)
    errors: dict[str, float] = {}
    bad: dict[str, float] = {}
    notes = []
    for name, result in results.items():
        if result.version != version:
            bad[name] = math.inf
            notes.append(f"{name} serves version {result.version}, not {version} (the refresh did not happen there)")
            continue
        err = max((abs(a - b) for a, b in zip(result.logprobs, expected_logprobs)), default=0.0)
        if any(math.isnan(x) for x in result.logprobs):
            err = math.nan
        errors[name] = err
        if not err <= atol:  # NaN fails too
            bad[name] = err
    if not results:
        raise RefreshVerificationError(version, {"<none>": math.inf}, atol, "No server answered the probe.")
    if bad:
        raise RefreshVerificationError(version, bad, atol, " ".join(notes))
    logger.info("refresh to version %d verified: max |delta log-prob| per server %s (atol %g)", version, errors, atol)
    return errors
