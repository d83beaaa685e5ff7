"""Router replay's engine half: the experts each token was routed to, recorded while generating.

``RoutingRecorder`` records them in the transformers engine. On GPUs vLLM returns them with each answer itself
(``enable_return_routed_experts``, its Model Runner V2; ``require_routing`` checks they came). vLLM CPU cannot, so its
workers record them (``fleet.routing.RoutingCapture``) and ``with_routing`` claims them for the samples.

In the transformers engine a forward hook on every layer's router (``mlp.gate``, which returns ``(logits, scores,
top-k indices)`` in transformers 5's Qwen3-MoE) keeps each call's ``[rows x positions, top_k]`` indices.
``generate`` calls the model once on the prompt (all rows at once) and once per new token (one position per row), so
a row's routing is its prompt's rows of the first call followed by its row of each later call; the last sampled token
is never fed back.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.fleet import routing
from megatron_offgrpo.rollout._samples import BadResponse


class RoutingRecorder:
    """Records the top-k experts of every MoE layer of ``model`` while ``recording()`` is open."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._calls: list[list[torch.Tensor]] = []  # per layer: each forward call's [rows * positions, k]
        self._routers = [m for name, m in model.named_modules() if name.endswith("mlp.gate") and hasattr(m, "top_k")]
        if not self._routers:
            raise ValueError("router replay needs a mixture-of-experts model: no `mlp.gate` routers found")
        self._active = False
        for layer, router in enumerate(self._routers):
            router.register_forward_hook(self._hook(layer))

    @property
    def layers(self) -> int:
        """MoE layers of the model."""
        return len(self._routers)

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            if self._active:
                self._calls[layer].append(output[2].to("cpu", torch.int16))

        return record

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the forwards inside (one ``generate`` call)."""
        self._calls = [[] for _ in self._routers]
        self._active = True
        try:
            yield
        finally:
            self._active = False

    def per_row(self, rows: int, prompt_len: int) -> torch.Tensor:
        """``[rows, prompt_len + steps - 1, layers, k]``: each row's routing over its input positions, where ``steps``
        is the number of forward calls after the prompt's plus one (the tokens generated)."""
        layers = []
        for calls in self._calls:
            prompt = calls[0].reshape(rows, prompt_len, -1)
            steps = [call.reshape(rows, 1, -1) for call in calls[1:]]
            layers.append(torch.cat([prompt, *steps], dim=1))
        return torch.stack(layers, dim=2)


def with_routing(
    samples: list[Sample], take: Callable[[list[str]], routing.RoutingAnswer], server: str
) -> list[Sample]:
    """``samples`` carrying the routing a vLLM worker recorded for them (``Sample.routed_experts``), asked of
    ``take`` once per distinct ``routing.routing_key`` (identical samples, e.g. a greedy group, share one routing).

    Raises:
        BadResponse: the worker did not return the routing of every sample (the reason is the worker's): the
            group is generated again.
    """
    keys = [routing.routing_key(s.prompt_ids + s.response_ids[:-1]) for s in samples]
    answer = take(list(dict.fromkeys(keys)))
    if not answer.ok:
        raise BadResponse(f"router replay: {server} has no routing for its samples: {answer.error}")
    return [dataclasses.replace(sample, routed_experts=torch.from_numpy(answer.routing[key].copy()))
            for sample, key in zip(samples, keys)]


def require_routing(samples: list[Sample], server: str) -> list[Sample]:
    """``samples`` from an engine that returns the routing with each answer (vLLM's ``enable_return_routed_experts``),
    checked to carry it.

    Raises:
        BadResponse: a sample without its routing (the server runs without the option): the group is generated again.
    """
    if any(sample.routed_experts is None for sample in samples):
        raise BadResponse(f"router replay: {server} answered without routed experts: serve the model with "
                          "--enable-return-routed-experts (offgrpo fleet start --record-routing on GPUs)")
    return samples
