"""``TransformersEngine``: the same ``RolloutEngine`` interface on plain ``transformers.generate``, for machines
without vLLM. One process, one model, no server: clearly slower at real sizes (no paged attention, no continuous
batching), chosen automatically only when vLLM is not installed.

Sampling draws each token from HF's own warpers' distribution (temperature, top-k, top-p, in ``generate``'s order) by
the fleet's exact inverse-CDF sampler (``fleet.cpu_sampler.sample_from_logprobs``), in a logits processor of a greedy
``generate``: ``torch.multinomial`` draws one exponential per vocabulary entry from the CPU generator, 65 ms a
decode step for 8 rows of Qwen's 151,936 entries on the 2-core CPU, half of a tiny model's generation time.

A sampled token's log-prob is log-softmax(logits / temperature) (the raw model's when greedy), like the fleet's
``logprobs_mode=processed_logprobs`` when top-p and top-k are off (vLLM also renormalises over the kept tokens
when they are on); probe log-probs are raw, as in vLLM. Refreshes go through the same checks as the fleet's
workers (manifest version and CRCs for a directory; the complete name/shape set always) before any parameter is
touched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import torch

from checkpoint_tools import expected_hf_shapes
from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.fleet import cpu_sampler
from megatron_offgrpo.rollout._errors import RefreshError, require_newer
from megatron_offgrpo.rollout._hf_params import parameter_view
from megatron_offgrpo.rollout._routing import RoutingRecorder
from megatron_offgrpo.rollout._samples import completions_to_ask, fill_group
from megatron_offgrpo.rollout._types import ProbeResult, RefreshReport
from megatron_offgrpo.transports import Buckets, packing, weights_dir


class TransformersEngine:
    """Generation with a HF ``AutoModelForCausalLM`` in this process.

    Attributes:
        name: server name put on samples ("transformers").
        concurrent_generate: False: calls from several threads take turns (HF's ``generate`` has no shared batch).
        partial_rollouts: False: a refresh waits for the generation in flight.
    """

    name = "transformers"
    concurrent_generate = False
    partial_rollouts = False

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 record_routing: bool = False) -> None:
        """Load ``model_dir`` (its version: the manifest's, else 0). ``record_routing``: MoE models only, every
        sample carries the experts each layer routed its tokens to (``Sample.routed_experts``, router replay)."""
        import transformers

        self.model_dir = Path(model_dir)
        self.device = torch.device(device)
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(self.device).eval()
        )
        config = self.model.config.to_dict()
        self._expected = expected_hf_shapes(config)
        self._eos = self._eos_ids()
        self._version = weights_dir.manifest_version(self.model_dir) or 0
        self._lock = threading.Lock()
        self._routing = RoutingRecorder(self.model) if record_routing else None

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = self.model.config.eos_token_id if eos is None else eos
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def version(self) -> int:
        """The version the model holds."""
        return self._version

    @torch.no_grad()
    def _group(self, prompt: Prompt, group_id: int, n: int, params: SamplingParams) -> list[Sample]:
        greedy = params.temperature == 0
        rows = completions_to_ask(params, n)
        if params.seed is not None:
            torch.manual_seed(params.seed + group_id)
        ids = torch.tensor([list(prompt.prompt_ids)] * rows, device=self.device)
        stops = self._eos + list(params.stop_token_ids)
        with self._routing.recording() if self._routing else contextlib.nullcontext():
            out = self._generate(ids, params, stops)
        new = out.sequences[:, ids.shape[1] :]
        routing = self._routing.per_row(rows, ids.shape[1]) if self._routing else None
        scale = 1.0 if greedy else params.temperature
        logits = torch.stack(out.logits, dim=1).float() / scale  # [rows, T, V] raw logits of each generated position
        logps = logits.log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [rows, T]
        samples = []
        for row in range(rows):
            tokens, values = new[row].tolist(), logps[row].tolist()
            end = next((t + 1 for t, tok in enumerate(tokens) if tok in stops), None)
            finish = "stop" if end is not None else "length"
            end = end or len(tokens)
            samples.append(
                Sample(
                    prompt.prompt_id,
                    group_id,
                    list(prompt.prompt_ids),
                    tokens[:end],
                    values[:end],
                    self._version,
                    finish,
                    server=self.name,
                    routed_experts=None if routing is None else routing[row, : ids.shape[1] + end - 1].clone(),
                )
            )
        return fill_group(samples, n)

    def _generate(self, ids: torch.Tensor, params: SamplingParams, stops: list[int]):
        """A greedy ``generate`` (sampling, when asked, happens in ``_DrawInProcessor``); no penalties or length
        floor of the model's generation_config (SamplingParams has none)."""
        draw = [] if params.temperature == 0 else [_DrawInProcessor(params)]
        return self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            logits_processor=draw,
            max_new_tokens=params.max_tokens,
            min_new_tokens=None,
            min_length=0,
            repetition_penalty=1.0,
            eos_token_id=stops or None,
            pad_token_id=(stops or [0])[0],
            output_logits=True,
            return_dict_in_generate=True,
        )

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[Sample]:
        """``len(prompts) * n`` samples, grouped by prompt (one ``generate`` call per group)."""
        if n < 1:
            raise ValueError(f"generate n={n}: the group size must be >= 1")
        with self._lock:
            return [s for i, p in enumerate(prompts) for s in self._group(p, i, n, p.sampling(params))]

    def update_weights(self, weights: Buckets | Path, version: int) -> RefreshReport:
        """Install ``version`` after checking it (a rejected refresh leaves the weights untouched).

        Raises:
            ValueError: a version that does not increase. RefreshError: a corrupt or incomplete refresh.
        """
        with self._lock:
            require_newer(version, self._version)
            start = time.perf_counter()
            try:
                tensors = (
                    weights_dir.read_version_dir(weights, version)
                    if isinstance(weights, (str, Path))
                    else [t for b in weights for t in b]
                )
                packing.check_complete({n: tuple(t.shape) for n, t in tensors}, self._expected)
            except ValueError as exc:
                raise RefreshError(int(version), {self.name: str(exc)}) from None
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in tensors:
                    parameter_view(params, name).copy_(tensor)
            self._version = int(version)
            nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
            return RefreshReport(
                self._version,
                "local",
                time.perf_counter() - start,
                {self.name: self._version},
                bytes=nbytes,
                tensors=len(tensors),
            )

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int]) -> dict[str, ProbeResult]:
        """log p(token_ids[t] | token_ids[:t]) for t >= 1, from one forward."""
        with self._lock:
            ids = torch.tensor([token_ids], device=self.device)
            logits = self.model(ids).logits[0, :-1].float()
            values = logits.log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1).tolist()
            return {self.name: ProbeResult(self._version, values)}

    def close(self) -> None:
        """Drop the model."""
        self.model = None


class _DrawInProcessor:
    """A logits processor that samples: HF's warpers for ``params`` (temperature, top-k, top-p, in ``generate``'s order
    when it samples), one exact draw per row from what they leave, and scores that are 0 at the drawn token and -inf
    elsewhere, so that the greedy step of ``generate`` takes it. Draws use the global generator, which
    ``_group`` seeds per group when ``params.seed`` is set."""

    def __init__(self, params: SamplingParams) -> None:
        from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(params.temperature)] if params.temperature != 1.0 else []
        if params.top_k > 0:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        token = cpu_sampler.sample_from_logprobs(scores.float().log_softmax(-1), {})
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)
