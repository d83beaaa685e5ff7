"""The worker extension's answer to one RPC: typed on both sides, a flat JSON dict in between."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

_SECONDS_SUFFIX = "_s"
"""A wire key ending so is a phase's wall seconds: ``"load_s": 0.4`` is ``seconds["load"]``."""

# The optional fields and the one JSON type each carries; bool is checked apart from int (True is an int in Python).
_FIELD_TYPES: dict[str, type] = {
    "error": str,
    "version": int,
    "tensors": int,
    "rank": int,
    "workers": int,
    "pid": int,
    "dtype": str,
    "staged": int,
    "tied_head_refreshed": bool,
    "moe_repacked": int,
    "sampler": str,
    "routing_source": str,
    "full_sync_needed": str,
}


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _unexpected(obj: Any) -> WorkerAnswer:
    return WorkerAnswer.failed(f"unexpected answer {obj!r}")


@dataclasses.dataclass(frozen=True)
class WorkerAnswer:
    """One worker's answer to a worker-extension RPC, or (``summarize``) one engine's answer folded from its workers'.

    On the wire (vLLM's ``collective_rpc``: pickled in process, JSON through a server's ``/collective_rpc``) it is
    the flat dict of ``to_wire``: ``{"ok": true, "version": 3, "tensors": 27, "load_s": 0.4}``. Unset fields stay
    out of it, so old and new servers and clients read each other's answers.

    Attributes:
        ok: the call did what it was asked. error: why not (None when ok).
        version: the version the worker serves after the call (``DIRTY`` after a reload that failed midway).
        tensors: tensors installed (loads) or served (``offgrpo_info``).
        rank: the worker's rank (``offgrpo_info``) or its rank in the refresh group (``offgrpo_join_group``).
        workers: worker answers folded into this one (1 for a worker's own).
        seconds: phase -> wall seconds on the worker (e.g. "read", "recv", "map", "load"); folded: the slowest.
        pid, dtype: the worker's process and the dtype it serves (``offgrpo_info``).
        staged: tensors a receive without commit holds for the version so far.
        tied_head_refreshed: a load re-derived the output layer tied to the embedding.
        moe_repacked: a load's MoE layers whose expert weights the worker re-packed into vLLM CPU's kernel layout
            after the reload left them in checkpoint layout (``fleet._moe_repack``); None for a model without
            such layers, 0 when the reload packed them itself.
        sampler: the worker's token sampler (``offgrpo_info``): "offgrpo-inverse-cdf" (``fleet._cpu_sampler``) or
            "vllm".
        routing_source: where a server's routing for router replay comes from (``offgrpo_routing_begin``):
            "vllm", each answer's choices carry it (``--enable-return-routed-experts``, GPU), or "hooks", the worker
            records it and the client claims it by ``routing_key`` (``fleet.routing.RoutingCapture``, CPU).
        full_sync_needed: a delta refused (the worker serves its previous version): why, and that a full sync of the
            same version repairs it (no image, another base, a missing tensor, a checksum mismatch).
    """

    ok: bool
    error: str | None = None
    version: int | None = None
    tensors: int | None = None
    rank: int | None = None
    workers: int = 1
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    pid: int | None = None
    dtype: str | None = None
    staged: int | None = None
    tied_head_refreshed: bool | None = None
    moe_repacked: int | None = None
    sampler: str | None = None
    routing_source: str | None = None
    full_sync_needed: str | None = None

    @classmethod
    def failed(cls, error: str, version: int | None = None) -> WorkerAnswer:
        """A refusal or failure: ``error`` says why; ``version`` the one the worker still serves, when known."""
        return cls(ok=False, error=error, version=version)

    def to_wire(self) -> dict[str, Any]:
        """The JSON-serialisable dict that crosses the process boundary (``from_wire`` reads it back)."""
        wire: dict[str, Any] = {"ok": self.ok}
        for name in _FIELD_TYPES:
            value = getattr(self, name)
            if value is not None and not (name == "workers" and value == 1):
                wire[name] = value
        wire.update({f"{phase}{_SECONDS_SUFFIX}": float(s) for phase, s in self.seconds.items()})
        return wire

    @classmethod
    def from_wire(cls, obj: Any) -> WorkerAnswer:
        """The answer a wire dict holds; anything else (not a dict, no bool ``ok``, a field of the wrong type) is a
        failed answer that quotes it. Keys this side does not know are skipped: a newer worker may add facts."""
        if not isinstance(obj, dict) or not _is(obj.get("ok"), bool):
            return _unexpected(obj)
        fields: dict[str, Any] = {}
        seconds: dict[str, float] = {}
        for key, value in obj.items():
            if key in _FIELD_TYPES:
                if value is None and key != "workers":  # None is the field's default: as if left out
                    continue
                if not _is(value, _FIELD_TYPES[key]):
                    return _unexpected(obj)
                fields[key] = value
            elif isinstance(key, str) and key.endswith(_SECONDS_SUFFIX):
                if not (_is(value, (int, float)) and math.isfinite(value)):
                    return _unexpected(obj)
                seconds[key.removesuffix(_SECONDS_SUFFIX)] = float(value)
        return cls(ok=obj["ok"], seconds=seconds, **fields)
