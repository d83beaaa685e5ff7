"""Typed records of the rollout room: a refresh report and the probe tolerances per dtype."""

from __future__ import annotations

import dataclasses

import torch

# The one table of default tolerances on |fleet log-prob - trainer log-prob| of the probe tokens, per dtype the
# comparison runs at (``rollout.verify_tolerance`` overrides it). fp32 on the same weights agrees to ~1e-5 (vLLM CPU
# vs a HF or megatron fp32 forward, measured: README's refresh table); bf16 kernels differ in accumulation order and
# rounding (~1e-2 per token on small models). A wrong tensor moves the probe by far more (tests: >0.1).
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


@dataclasses.dataclass
class RefreshReport:
    """What one weight refresh did.

    Attributes:
        version: the version now served. transport: "disk", "collective", "memory" or "local".
        seconds: wall time of the whole refresh (write or broadcast, pause, reload, resume).
        servers: server name -> the version each server reports after the refresh.
        bytes: payload bytes sent or written. tensors: tensors installed. buckets: messages or files used.
        detail: per-phase seconds (e.g. "write", "pause", "load", "resume") and transport specifics.
    """

    version: int
    transport: str
    seconds: float
    servers: dict[str, int]
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    detail: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """One server's answer to a probe: the version it served and log p(probe[t] | probe[:t]) for t >= 1 ([T-1])."""

    version: int
    logprobs: list[float]
