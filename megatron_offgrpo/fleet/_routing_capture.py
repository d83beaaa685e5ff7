"""The experts a vLLM worker routed each token to, recorded for router replay (``model.router_replay``).

vLLM's own routed-experts output needs its Model Runner V2 (Triton), which vLLM CPU does not run, and CUDA graphs
skip Python hooks: so the worker records the routing itself, in eager mode. A forward hook on every MoE layer's
router (``mlp.gate``) takes the top-k of its logits for each token of a step, and a wrapper around the model
runner's forward says which request and position each token of that step is (the runner's ``input_batch.req_ids``
and ``query_start_loc``, the forward's ``positions`` and ``input_ids``). A request's routing is kept by position,
so chunked prefill and a recompute after preemption land in place.

vLLM's internal request ids carry random suffixes the client never sees, so a routing is claimed by its token
sequence (``routing_key``: the prompt and every generated token but the last, which is never fed back). Prefix
caching must be off (``offgrpo fleet start --record-routing``): a cached prompt is computed by another request, and
a request that starts past position 0 is refused rather than given a partial routing.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from typing import Any, Sequence

import numpy as np
import torch


def routing_key(token_ids: Sequence[int]) -> str:
    """The key of the routing of a sequence whose input positions hold ``token_ids``."""
    return hashlib.sha1(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class RoutingAnswer:
    """A worker's answer to ``offgrpo_routing_take``: one ``[positions, layers, top_k]`` routing per key asked.

    On the wire a JSON dict: ``{"ok": true, "routing": {key: {"shape": [...], "data": base64 int16}}}``.
    """

    ok: bool
    error: str | None = None
    routing: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        if not self.ok:
            return {"ok": False, "error": self.error}
        encoded = {
            key: {"shape": list(r.shape), "data": base64.b64encode(r.astype("<i2").tobytes()).decode("ascii")}
            for key, r in self.routing.items()
        }
        return {"ok": True, "routing": encoded}

    @classmethod
    def from_wire(cls, wire: Any) -> RoutingAnswer:
        if not isinstance(wire, dict) or not isinstance(wire.get("ok"), bool):
            return cls(False, f"unexpected answer {wire!r}"[:300])
        if not wire["ok"]:
            return cls(False, str(wire.get("error")))
        routing = {
            key: np.frombuffer(base64.b64decode(item["data"]), dtype="<i2").reshape(item["shape"])
            for key, item in (wire.get("routing") or {}).items()
        }
        return cls(True, routing=routing)


class _Record:
    """One request's tokens and routing by input position (grown as the request runs)."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.tokens = np.full(64, -1, dtype=np.int64)
        self.routing = np.zeros((64, layers, top_k), dtype=np.int16)
        self.length = 0
        self._key: str | None = None  # cached between writes: every take (one per group on a fleet) asks it

    def write(self, positions: np.ndarray, tokens: np.ndarray, routing: np.ndarray) -> None:
        end = int(positions.max()) + 1
        if end > len(self.tokens):
            grow = max(end, 2 * len(self.tokens)) - len(self.tokens)
            self.tokens = np.concatenate([self.tokens, np.full(grow, -1, dtype=np.int64)])
            self.routing = np.concatenate([self.routing, np.zeros((grow, *self.routing.shape[1:]), np.int16)])
        self.tokens[positions] = tokens
        self.routing[positions] = routing
        self.length = max(self.length, end)
        self._key = None

    def key(self) -> str | None:
        """The routing key, or None when a position was never computed here (a prefix from the cache)."""
        if self._key is None:
            tokens = self.tokens[: self.length]
            self._key = None if (tokens < 0).any() else routing_key(tokens)
        return self._key


class RoutingCapture:
    """Records the routing of every request a vLLM model runner computes while ``active``."""

    def __init__(self, runner: Any) -> None:
        model = runner.get_model()
        self._gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]
        if not self._gates:
            raise ValueError("router replay needs a mixture-of-experts model: no `mlp.gate` routers served")
        hf_config = runner.model_config.hf_config
        self.top_k = int(hf_config.num_experts_per_tok)
        self._runner = runner
        self._records: dict[str, _Record] = {}
        self._step: list[torch.Tensor] = []
        self.active = False
        for gate in self._gates:
            gate.register_forward_hook(self._on_router)
        original = runner._model_forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            self._step = []
            output = original(*args, **kwargs)
            self._store(kwargs.get("input_ids"), kwargs.get("positions"))
            return output

        runner._model_forward = forward  # instance attribute: this runner only

    def _on_router(self, module: Any, inputs: Any, output: Any) -> None:
        if self.active:
            logits = output[0] if isinstance(output, tuple) else output
            # vLLM's fused MoE takes the top-k of the fp32 softmax; the same order of the logits gives the same set
            self._step.append(torch.topk(logits.float(), self.top_k, dim=-1).indices.to("cpu", torch.int16))

    def _store(self, input_ids: torch.Tensor | None, positions: torch.Tensor | None) -> None:
        """File the step's routing under each request of the batch, at its positions."""
        batch = self._runner.input_batch
        num_reqs = batch.num_reqs
        starts = self._runner.query_start_loc.np[: num_reqs + 1]
        total = int(starts[-1])
        if input_ids is None or positions is None or len(self._step) != len(self._gates) or total == 0:
            return  # a dummy/profile forward, or one without token ids: nothing a request will claim
        routing = torch.stack([layer[:total] for layer in self._step], dim=1).numpy()  # [tokens, layers, k]
        tokens = input_ids[:total].cpu().numpy()
        where = positions[:total].cpu().numpy()
        for index, req_id in enumerate(batch.req_ids[:num_reqs]):
            lo, hi = int(starts[index]), int(starts[index + 1])
            if hi > lo:
                record = self._records.setdefault(req_id, _Record(len(self._gates), self.top_k))
                record.write(where[lo:hi], tokens[lo:hi], routing[lo:hi])

    def begin(self) -> None:
        """Forget earlier records (a new generation call) and record from now on."""
        self._records.clear()
        self.active = True

    def take(self, keys: list[str]) -> RoutingAnswer:
        """The routing of each key (dropped from the store); an error names how many were not recorded."""
        wanted, by_key, partial = set(keys), {}, 0
        for req_id, record in list(self._records.items()):
            key = record.key()
            if key is None:
                partial += 1
            elif key in wanted:
                by_key[key] = record.routing[: record.length].copy()
                del self._records[req_id]
        missing = [k for k in keys if k not in by_key]
        if missing:
            why = (f" ({partial} request(s) started past position 0: prefix caching is on)" if partial else "")
            return RoutingAnswer(False, f"no recorded routing for {len(missing)} of {len(keys)} sequence(s){why}")
        return RoutingAnswer(True, routing={k: by_key[k] for k in keys})
