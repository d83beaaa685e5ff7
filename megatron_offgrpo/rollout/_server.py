"""One vLLM server of the fleet, seen from the trainer: generation, scoring, control calls and worker RPCs over
HTTP."""

from __future__ import annotations

import dataclasses
import functools
import uuid
from typing import Any, Callable

from megatron_offgrpo.data import Prompt, SamplingParams
from megatron_offgrpo.fleet import FleetState, json_http, processes, records
from megatron_offgrpo.rollout._dispatch import unless_given_up
from megatron_offgrpo.rollout._samples import BadResponse, sampling_body
from megatron_offgrpo.transports import adapters, calls


@dataclasses.dataclass
class ServerClient:
    """HTTP client of one server (started by the fleet launcher, or any vLLM server with our worker extension).

    Attributes:
        name: label in logs, samples and errors (e.g. "s0@127.0.0.1:8100"). url: "http://host:port".
        model: the served model name. token: the fleet token (None when the fleet has none).
        generate_timeout_s: bound on one generation or scoring request (``classify``: queued behind others on a
            busy server). control_timeout_s: bound on a control call
            (a pause waits for in-flight requests to drain; a reload of a large model takes seconds).
        given_up: None, or why the fleet gave this server up (``ServerPool.why_dead``): a call in flight is then
            abandoned at once (``ServerDown``) instead of waiting out its timeout on a frozen server; a
            ``FleetEngine`` sets it on its servers. ``health`` and ``check_health`` are never given up.
    """

    name: str
    url: str
    model: str = "policy"
    token: str | None = None
    generate_timeout_s: float = 600.0
    control_timeout_s: float = 600.0
    given_up: Callable[[], str | None] | None = dataclasses.field(default=None, repr=False, compare=False)

    def _request(self, method: str, path: str, body: Any = None, timeout: float | None = None, query: str = "") -> Any:
        call = functools.partial(json_http.call_json, method, self.url + path, body, self.token,
                                 timeout or self.control_timeout_s, query)
        return call() if self.given_up is None else unless_given_up(self.given_up, call)

    def _post(self, path: str, body: Any = None, timeout: float | None = None, query: str = "") -> Any:
        return self._request("POST", path, body, timeout, query)

    def health(self, timeout: float = 5.0) -> bool:
        """True when the server answers ``/health``."""
        return processes.server_healthy(self.url, timeout)

    def check_health(self, timeout: float = 5.0) -> None:
        """Raises ``ServerDown`` (or ``RequestRejected``) unless the server answers ``/health`` within ``timeout``."""
        processes.check_server_health(self.url, timeout)

    def generate(self, prompt: Prompt, n: int, params: SamplingParams, group_id: int) -> dict[str, Any]:
        """One group: all ``n`` samples of ``prompt`` in one request (so they share server and version)."""
        body = {
            "token_ids": list(prompt.prompt_ids),
            "model": self.model,
            "sampling_params": sampling_body(prompt.sampling(params), n, group_id),
            "request_id": f"offgrpo-g{group_id}-{uuid.uuid4().hex[:12]}",
        }
        if params.priority:  # a server without --scheduling-policy priority ignores it (fleet start sets the flag)
            body["priority"] = params.priority
        return self._post("/inference/v1/generate", body, self.generate_timeout_s)

    def probe(self, token_ids: list[int]) -> dict[str, Any]:
        """Score ``token_ids`` (prompt log-probs) with one greedy token generated after them."""
        params = {"n": 1, "max_tokens": 1, "temperature": 0.0, "logprobs": 0, "prompt_logprobs": 0, "detokenize": False}
        body = {"token_ids": list(token_ids), "model": self.model, "sampling_params": params}
        return self._post("/inference/v1/generate", body, self.generate_timeout_s)

    def classify(self, token_ids: list[int]) -> float:
        """The raw score of ``token_ids`` by a sequence classifier with one label (a reward model on a fleet started
        on it: vLLM's pooling runner), through ``/classify``: the head's logit at the last token, as HF's
        ``*ForSequenceClassification`` gives it (the sigmoid vLLM applies by default is turned off here too, so a
        server started without the fleet's pooler settings answers the same).

        Raises:
            BadResponse: the answer holds no single score (a classifier of several labels), naming the server.
            json_http.ServerDown / RequestRejected: the server is unreachable or refused the request.
        """
        body = {"model": self.model, "input": [int(t) for t in token_ids], "use_activation": False}
        answer = self._post("/classify", body, self.generate_timeout_s)
        try:
            (row,) = answer["data"]
            (score,) = row["probs"]
            return float(score)
        except (KeyError, TypeError, ValueError) as exc:  # not one row of one number
            raise BadResponse(f"server {self.name}: /classify answer is not one score of one label "
                              f"({type(exc).__name__}: {str(answer)[:200]})") from None

    def pause(self, keep_in_flight: bool = False) -> None:
        """Stop scheduling: once the in-flight requests have finished (``/pause?mode=wait``), or at once with them
        frozen where they are, to go on after ``resume`` (``keep_in_flight``, partial rollouts: ``mode=keep``)."""
        self._post("/pause", query="mode=keep" if keep_in_flight else "mode=wait")

    def resume(self) -> None:
        """Resume scheduling."""
        self._post("/resume")

    def reset_prefix_cache(self, in_flight: bool = False) -> bool:
        """Drop the KV blocks computed with the previous weights; True when vLLM did. ``in_flight`` (partial
        rollouts): also those of the paused requests, which vLLM preempts and recomputes (prompt and tokens so far)
        with the new weights when they resume; without it vLLM refuses while a request holds blocks."""
        answer = self._post("/reset_prefix_cache", query="reset_running_requests=true" if in_flight else "")
        return bool((answer or {}).get("success", True))  # a vLLM before the field answered nothing

    def set_version_label(self, version: int) -> None:
        """Label the tokens the engine produces from now on with ``version`` (vLLM's ``weight_versions``)."""
        self._post("/update_weight_version", {"new_version": str(version)})

    def version_label(self) -> str:
        """The engine's current weight-version label."""
        info = self._request("GET", "/weight_info")
        return str(info["weight_version"])

    def call(self, request: calls.WorkerRequest, timeout: float) -> list[object]:
        """Call ``request``'s worker-extension method on every worker of this server; one result dict per worker."""
        body = {"method": request.METHOD, "kwargs": {"payload": request.to_payload()}, "timeout": timeout}
        answer = self._post("/collective_rpc", body, timeout + 30.0)
        return list((answer or {}).get("results") or [])

    def reply(self, token_ids: list[int], max_tokens: int, temperature: float, seed: int,
              top_logprobs: int) -> tuple[list[int], dict[int, float]]:
        """One reply to ``token_ids`` (a judge's): its token ids and its first token's ``top_logprobs`` candidates
        (token id -> log-prob), greedy at temperature 0, else sampled with ``seed``.

        Raises:
            BadResponse: an answer without one choice, its token ids or the first token's candidates.
        """
        params = sampling_body(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed), 1, 0)
        params["logprobs"] = top_logprobs
        body = {"token_ids": list(token_ids), "model": self.model, "sampling_params": params}
        answer = self._post("/inference/v1/generate", body, self.generate_timeout_s)
        try:
            (choice,) = answer["choices"]
            ids = [int(t) for t in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content") or []
            first = {int(c["token_id"]): float(c["logprob"]) for c in content[0]["top_logprobs"]} if ids else {}
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise BadResponse(f"server {self.name}: a reply without one choice, its token ids and the first token's "
                              f"log-probs ({type(exc).__name__}: {str(answer)[:200]})") from None
        return ids, first


def servers_of(state: FleetState, token: str | None = None, **kwargs: Any) -> list[ServerClient]:
    """``ServerClient``s of a recorded fleet (``fleet.load_state``; token: ``records.fleet_token`` unless given); a
    fleet serving the policy's LoRA adapter is asked for it by name in every request (probes too)."""
    token = token if token is not None else records.fleet_token(state)
    model = state.served_model_name if state.lora is None else adapters.LORA_NAME
    return [ServerClient(s.name, s.url, model, token, **kwargs) for s in state.servers]
