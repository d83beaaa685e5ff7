"""Typed records of the rollout room: a refresh report and the probe tolerances per dtype."""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

# The one table of default tolerances on |fleet log-prob - trainer log-prob| of the probe tokens, per dtype the
# comparison runs at (``rollout.verify_tolerance`` overrides it). A trainer that serves float32 derives its bound
# from the model instead (``probe_bound``); the float32 entry is for callers without the model's sizes (same weights,
# a small vocabulary: ~1e-5). bf16 kernels differ in accumulation order and rounding (~1e-2 per token on small
# models). A wrong tensor moves the probe by far more (tests: >0.1).
PROBE_ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.05, torch.float16: 0.03}


def probe_atol(dtype: torch.dtype | str) -> float:
    """The default probe tolerance (``PROBE_ATOL``) of a dtype ("float32", "bfloat16", "float16" or a torch dtype).

    Raises:
        ValueError: for a dtype without a stated tolerance.
    """
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype not in PROBE_ATOL:
        raise ValueError(f"dtype={dtype!r} has no probe tolerance: use one of {sorted(str(d) for d in PROBE_ATOL)}")
    return PROBE_ATOL[dtype]


FP32_UNIT_ROUNDOFF = 2.0 ** -24
"""u of float32 (half its machine epsilon): a rounded float32 operation is exact times (1 + d), |d| <= u."""


def _gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of a sum (or dot product) of n terms in
    any order, each step rounded."""
    return n * u / (1.0 - n * u)


def probe_bound(vocab_size: int, hidden_size: int, logit_bound: float, u: float = FP32_UNIT_ROUNDOFF) -> float:
    """The most an fp32 engine's probe log-prob can differ from the trainer's exact log-softmax of the same weights.

    ``log p_t = z_t - log sum_j exp(z_j)`` over the vocabulary (V terms) with logits ``z_j = h . W_j`` (H terms):

    - the engine sums the V positive terms ``exp(z_j - max)`` in fp32 in an order of its own: relative error of the
      sum <= ``gamma_{V-1}`` (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2), so its log-sum-exp is
      off by at most that (this term does not depend on the weights and dominates at a large vocabulary: a
      151,936-token sum was measured 5.3e-4 off on one CPU, where the trainer's TP2 split halved it);
    - each logit is a length-H dot product, off by at most ``gamma_H sum_i |h_i W_ji| <= gamma_H logit_bound`` on
      each side (``logit_bound`` >= every ``||h|| ||W_j||``), and it enters ``log p_t`` twice (target logit, and the
      softmax-weighted mean of the logits in the log-sum-exp): ``4 gamma_H logit_bound`` for both sides.

    The layers before the output layer round in both evaluations too; on the same weights that moved the probe by
    <= 4e-6 (the warm-up model, TP1 and TP2 trainer vs HF in float64), far inside this bound.

    Args:
        vocab_size: V, the rows of the output layer. hidden_size: H.
        logit_bound: an upper bound of ``||h_t|| ||W_j||`` over the probe's positions and the vocabulary.
        u: the unit roundoff of the engine's arithmetic (float32).

    Returns:
        The tolerance on max |engine - trainer| per probe token.
    """
    if vocab_size < 1 or hidden_size < 1 or not logit_bound >= 0:
        raise ValueError(f"probe_bound: vocab_size={vocab_size}, hidden_size={hidden_size} must be >= 1 and "
                         f"logit_bound={logit_bound} >= 0")
    return _gamma(vocab_size - 1, u) + 4 * _gamma(hidden_size, u) * logit_bound


@dataclasses.dataclass
class RefreshReport:
    """What one weight refresh did.

    Attributes:
        version: the version now served. transport: "disk", "collective", "memory" or "local".
        seconds: wall time of the whole refresh (write or broadcast, pause, reload, resume).
        servers: server name -> the version each server reports after the refresh.
        bytes: payload bytes sent or written. tensors: tensors installed. buckets: messages or files used.
        detail: per-phase seconds (e.g. "write", "pause", "load", "resume") and transport specifics.
        kind: what the refresh moved: the whole model ("full"), the policy's LoRA adapter ("adapter"), or the changed
            elements of the whole model ("delta": then ``detail`` holds ``changed_fraction``, ``encode_s``).
        full_sync: why engines that were sent a delta got the full version instead (``rollout.sync=delta``: a
            ``transports.deltas.FullSyncReason``, "refused: no image" after a restart, "refused: base",
            "refused: checksum"...), per engine; {} when none did.
    """

    version: int
    transport: str
    seconds: float
    servers: dict[str, int]
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    detail: dict[str, float] = dataclasses.field(default_factory=dict)
    kind: Literal["full", "adapter", "delta"] = "full"
    full_sync: dict[str, str] = dataclasses.field(default_factory=dict)  # values: a deltas.FullSyncReason


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One server's answer to a probe: the version it served and log p(probe[t] | probe[:t]) for t >= 1 ([T-1])."""

    version: int
    logprobs: list[float]
