"""``VLLMEngine``: the ``RolloutEngine`` interface on an in-process vLLM engine, with the fleet's refresh API.

The engine runs the same worker extension as the fleet's servers, so refreshes are checked the same way. Buckets
are handed to the worker in memory when the engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
the default this class sets: it also starts in seconds instead of ~30 s on CPU); with a separate engine process
they go through a temporary version directory. Every call into a separate engine process waits only while that
process lives (``_liveness``): a killed engine core ends the call with ``EngineDiedError`` within a fraction of a
second, where vLLM alone would wait forever. One thread drives the engine (``_engine_loop``): generations asked for
by several threads share its continuous batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.fleet import cpu_sampler, routing, serving
from megatron_offgrpo.rollout._engine_loop import EngineLoop
from megatron_offgrpo.rollout._errors import RefreshError, UnservableModelError, require_newer
from megatron_offgrpo.rollout._liveness import call_while_alive
from megatron_offgrpo.rollout._routing import require_routing, with_routing
from megatron_offgrpo.rollout._vllm_core import VllmCore
from megatron_offgrpo.rollout._vllm_support import unservable_reason
from megatron_offgrpo.rollout._samples import (
    BadResponse,
    fill_group,
    parse_token_versions,
    parse_version,
    routing_tensor,
    sampling_body,
)
from megatron_offgrpo.rollout._types import ProbeResult, RefreshReport
from megatron_offgrpo.transports import Buckets, WorkerAnswer, adapters, calls, deltas, summarize, weights_dir


def tokenizer_eos_id(model_dir: Path) -> int | None:
    """The end-of-sequence token id of ``model_dir``'s tokenizer, read from its files as transformers resolves it
    (``eos_token`` of tokenizer_config.json or special_tokens_map.json, its id among the added tokens or the
    vocabulary), or None when the files do not say (vLLM then loads the tokenizer for it)."""

    def read(name: str) -> dict:
        try:
            return json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            return {}

    config = read("tokenizer_config.json")
    eos = config.get("eos_token") or read("special_tokens_map.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    ids = {token.get("content"): int(i) for i, token in config.get("added_tokens_decoder", {}).items()}
    ids = {**read("vocab.json"), **read("added_tokens.json"), **ids}
    tokenizer = read("tokenizer.json")
    vocab = tokenizer.get("model", {}).get("vocab")  # a list of (token, score) for unigram models
    ids = {**ids, **(vocab if isinstance(vocab, dict) else {}),
           **{token.get("content"): token.get("id") for token in tokenizer.get("added_tokens", [])}}
    return ids[eos] if isinstance(ids.get(eos), int) else None


def _on_gpu() -> bool:
    """Whether vLLM runs on CUDA (or ROCm) here, not on the CPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


def _returns_routing() -> bool:
    """Whether this vLLM returns each request's routed experts itself (``enable_return_routed_experts``): its Model
    Runner V2 does, on CUDA (or ROCm) with Triton. vLLM CPU runs the V1 runner, which cannot."""
    return _on_gpu()


def _engine_processes(llm) -> list:
    """The engine-core processes vLLM started for ``llm`` ([] when the engine core runs in this process). vLLM's
    client keeps them as ``multiprocessing`` processes under ``engine_core.resources.engine_manager``; a vLLM that
    keeps them elsewhere gets no watch (a warning says so) rather than a failure."""
    manager = getattr(getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None), "engine_manager", None)
    processes = list(getattr(manager, "processes", None) or [])
    if not processes:
        logging.getLogger(__name__).warning("vLLM's engine-core processes not found: a dead engine core will not be "
                                            "noticed (this vLLM keeps them elsewhere)")
    return processes


def _choose_executor(in_process: bool) -> bool:
    """Whether vLLM's engine core runs in this process (refreshes hand tensors over in memory). Not under a
    torch.distributed job of several processes: vLLM would take the job's process group for its own and wait for
    ranks that never join, so its engine core gets a fresh process of its own (spawned: a fork would inherit the
    job's process group)."""
    if in_process and _world_size() == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class VLLMEngine:
    """An in-process vLLM engine (``VllmCore``) behind the ``RolloutEngine`` interface."""

    name = "vllm"

    def __init__(self, model_dir: str | Path, dtype: str = "auto", max_model_len: int = 2048, max_num_seqs: int = 256,
                 in_process: bool = True, record_routing: bool = False, partial_rollouts: bool = False,
                 lora: adapters.AdapterSpec | None = None, **llm_kwargs: Any) -> None:
        """Start the engine on ``model_dir`` with the settings a fleet server runs with (``fleet.serving.VllmSettings``;
        extra ``llm_kwargs`` are ``vllm.EngineArgs`` fields, which win).

        Args:
            dtype: vLLM's dtype. max_model_len: longest prompt + completion. max_num_seqs: sequences generated at
                once; with ``max_model_len`` it sizes the KV cache, never vLLM's fraction of the machine's memory.
            in_process: run vLLM's engine core in this process (``_choose_executor``: not under a multi-rank job).
            record_routing: MoE models: every sample carries its routing (router replay; on CPU recorded by the
                worker's hooks, prefix caching off, eager only).
            partial_rollouts: a refresh may come while generations are in flight; it drops every KV block, the
                in-flight requests' too (vLLM recomputes them with the new weights), each token keeping its version.
            lora: the policy's LoRA adapter (``lora.sync=adapter``): every request (generation and probe) is served
                with the engine's one adapter slot, version 0 the all-zero adapter of this shape (the base's
                outputs), and refreshes take ``adapters.AdapterPayload``s.

        Raises:
            ValueError: ``record_routing`` on a model without routers, on CPU without eager execution, or with
                ``partial_rollouts`` (a routing a refresh changes halfway cannot be replayed).
            UnservableModelError: a model vLLM here has no attention kernel for, before the engine starts.
        """
        if partial_rollouts and record_routing:
            raise ValueError("VLLMEngine partial_rollouts=True with record_routing=True: a sample's routing would "
                             "change at the refresh and router replay could not reproduce it")
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        if (reason := unservable_reason(hf_config)) is not None:  # first: nothing set up, no engine that would crash
            raise UnservableModelError(f"vLLM cannot serve {model_dir}: {reason}")
        self.in_process = _choose_executor(in_process)
        cpu_sampler.install()  # in this process: the engine core's worker may be built here (see fleet._cpu_sampler)
        self.model_dir = Path(model_dir).resolve()
        # Requests are token ids in and out: vLLM's tokenizer would only give the end-of-sequence id, and loading it
        # (then deep-copying it into a thread pool, and listing its vocabulary) took 3.3 s of every engine start on
        # the loaded 2-core CPU. The id read from the tokenizer's files stops every request as vLLM's eos would.
        self._eos = None if "skip_tokenizer_init" in llm_kwargs else tokenizer_eos_id(self.model_dir)
        settings = serving.VllmSettings.build(
            self.model_dir, dtype, max_model_len, max_num_seqs,
            serving.kv_cache_bytes(hf_config, max_model_len, max_num_seqs, dtype), on_gpu=_on_gpu(),
            enforce_eager=llm_kwargs.pop("enforce_eager", True), record_routing=record_routing,
            skip_tokenizer_init=True if self._eos is not None else None, lora=lora)
        self._tmp = tempfile.TemporaryDirectory(prefix="offgrpo-vllm-refresh-")
        self.lora = lora
        # the settings a fleet server runs with too; then what only an in-process engine takes (and a caller's own)
        args = {**settings.engine_args(), "use_tqdm_on_load": False, **llm_kwargs}
        self.llm = VllmCore(self._first_adapter(hf_config), **args)
        self.partial_rollouts, self.record_routing = partial_rollouts, record_routing
        self.processes = [] if self.in_process else _engine_processes(self.llm)  # watched during every call
        self._loop = EngineLoop(self.llm, lambda fn: call_while_alive(self.processes, fn))
        self._routing_lock = threading.Lock()  # hooks routing: one generation at a time (see concurrent_generate)
        self._version = self._first_version()
        self._routing_source = self._begin_routing() if record_routing else None
        # Generations from several threads share the engine's batch (``EngineLoop``), except where the worker's
        # routing hooks record one generation's experts at a time.
        self.concurrent_generate = self._routing_source != "hooks"

    def _first_adapter(self, hf_config: dict[str, Any]) -> Any:
        """The ``LoRARequest`` of every request: the engine's slot, first loaded from an all-zero adapter written to
        the refresh directory (PEFT starts B at zero: version 0 is the base); None without ``lora``."""
        if self.lora is None:
            return None
        from vllm.lora.request import LoRARequest

        path = adapters.write_adapter_dir(Path(self._tmp.name) / "adapter-v0", self.lora,
                                          adapters.zero_adapter(self.lora, hf_config), str(self.model_dir))
        return LoRARequest(adapters.LORA_NAME, adapters.SLOT_ID, str(path))

    def _first_version(self) -> int:
        """The version the workers serve (their manifest's, or 0), which labels the engine's tokens from now on."""
        info = self._rpc(calls.Info())
        if not info.ok or info.version is None:
            raise RuntimeError(f"{calls.Info.METHOD} failed ({info.error}): is vLLM running the worker extension?")
        logging.getLogger(__name__).info("in-process vLLM engine: version %d, token sampler %s", info.version,
                                         info.sampler)
        self._call(self.llm.llm_engine.set_weight_version, str(info.version))
        return info.version

    def _begin_routing(self) -> str | None:
        """Where each sample's routing comes from: "vllm" (with each completion) or "hooks" (claimed from the worker);
        refused now (a dense model, say), not at the first generation."""
        answer = self._rpc(calls.RoutingBegin())
        if not answer.ok:
            self.close()
            raise ValueError(f"VLLMEngine record_routing=True: {answer.error}")
        return answer.routing_source

    def _rpc(self, request: calls.WorkerRequest) -> WorkerAnswer:
        return self._loop.run(lambda: self._rpc_now(request))

    def _rpc_now(self, request: calls.WorkerRequest) -> WorkerAnswer:
        """A worker-extension call from the engine's loop thread itself (inside a ``_loop.run`` job)."""
        return summarize(self._collective(request))

    def _collective(self, request: calls.WorkerRequest) -> list[object]:
        return self.llm.collective_rpc(request.METHOD, kwargs={"payload": request.to_payload()})

    def _call(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the engine's loop between decode steps, ended by ``EngineDiedError`` if the
        engine's process dies."""
        return self._loop.run(lambda: fn(*args, **kwargs))

    def version(self) -> int:
        """The version the engine holds."""
        return self._version

    def _params(self, params: SamplingParams, n: int, group_id: int):
        from vllm.sampling_params import SamplingParams as VllmParams

        body = sampling_body(params, n, group_id)
        if self._eos is not None:  # vLLM has no tokenizer to take it from (see __init__)
            body["stop_token_ids"] = sorted({*body.get("stop_token_ids", ()), self._eos})
        return VllmParams(**body)

    def generate(self, prompts: list[Prompt], n: int, params: SamplingParams) -> list[Sample]:
        """``len(prompts) * n`` samples, grouped by prompt, tagged with the engine's version label spans."""
        if n < 1:
            raise ValueError(f"generate n={n}: the group size must be >= 1")
        hooks = self._routing_source == "hooks"
        with self._routing_lock if hooks else contextlib.nullcontext():
            if hooks:
                self._rpc(calls.RoutingBegin())
            outputs = self._loop.generate([list(p.prompt_ids) for p in prompts],
                                          [self._params(p.sampling(params), n, i) for i, p in enumerate(prompts)],
                                          priority=params.priority)
            samples = self._samples(prompts, outputs, n)
            if hooks:
                samples = with_routing(samples, self._take_routing, self.name)
            elif self.record_routing:
                samples = require_routing(samples, self.name)
        return samples

    def _take_routing(self, keys: list[str]) -> routing.RoutingAnswer:
        return routing.RoutingAnswer.from_wire(self._call(self._collective, calls.RoutingTake(keys=keys))[0])

    def _samples(self, prompts: list[Prompt], outputs: list[Any], n: int) -> list[Sample]:
        samples = []
        for index, (prompt, output) in enumerate(zip(prompts, outputs)):
            group = []
            for completion in output.outputs:
                where = f"prompt {prompt.prompt_id} (group {index})"
                spans = [{"version": s.version, "start": s.start, "end": s.end}
                         for s in completion.weight_versions or []]
                logprobs = [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)]
                if completion.finish_reason not in ("stop", "length"):
                    raise BadResponse(f"{where}: finish_reason {completion.finish_reason!r}")
                version, token_versions = parse_token_versions(spans, len(completion.token_ids), where)
                group.append(
                    Sample(
                        prompt.prompt_id,
                        index,
                        list(prompt.prompt_ids),
                        list(completion.token_ids),
                        logprobs,
                        version,
                        completion.finish_reason,
                        server=self.name,
                        routed_experts=routing_tensor(completion.routed_experts),
                        token_versions=token_versions,
                    )
                )
            samples.extend(fill_group(group, n))
        return samples

    def update_weights(self, weights: Buckets | Path | adapters.AdapterPayload | deltas.DeltaPayload,
                       version: int) -> RefreshReport:
        """Install ``version`` (a directory, or buckets in memory / via a temporary directory; or, on an engine started
        with ``lora``, an ``adapters.AdapterPayload``; or a ``deltas.DeltaPayload``), reset the cache.

        The install, the cache reset and the new version label are one call on the engine's loop, between two
        decode steps: generations in flight (``partial_rollouts``) go on under the new weights (their KV recomputed
        with them), and every token sampled from then on carries the new version. An adapter is swapped into the
        engine's one LoRA slot the same way (built and checked first; when it fails the previous adapter serves on).
        A delta the worker refuses (it keeps its version) is followed at once by the same version whole
        (``RefreshReport.full_sync`` says why).

        Raises:
            ValueError: a version that does not increase; an adapter on an engine started without ``lora``.
            RefreshError: the worker rejected the weights (the previous version still serves unless it says dirty).
        """
        with self._routing_lock:  # refreshes come from one thread; this only orders them against hooks routing
            require_newer(version, self._version)
            start = time.perf_counter()
            transport, answer, nbytes = self._install(weights, version)
            full_sync = {}
            if not answer.ok and isinstance(weights, deltas.DeltaPayload) and weights.spec.base is not None:
                full_sync[self.name] = deltas.refusal(answer.full_sync_needed)
                logging.getLogger(__name__).warning("delta to version %d refused (%s): sending it whole", version,
                                                    answer.error)
                transport, answer, more = self._install(weights.as_full(), version)
                nbytes += more
            if not answer.ok:
                raise RefreshError(int(version), {self.name: str(answer.error)})
            self._version = int(version)
            detail = {f"{phase}_s": seconds for phase, seconds in answer.seconds.items()}
            if isinstance(weights, deltas.DeltaPayload):
                detail.update(weights.summary())
            kind = "full" if full_sync else deltas.kind_of(adapters.split_payload(weights)[1],
                                                           deltas.split_payload(weights)[1])
            return RefreshReport(self._version, transport, time.perf_counter() - start, {self.name: self._version},
                                 bytes=nbytes, tensors=answer.tensors or 0, detail=detail, kind=kind,
                                 full_sync=full_sync)

    def _install(self, weights: Any, version: int) -> tuple[str, WorkerAnswer, int]:
        """One install of ``weights`` as ``version`` on the engine's loop: (transport, the worker's answer, bytes)."""
        transport, tensors, path, adapter, delta, nbytes = self._stage(weights, version)
        wire = None if adapter is None else adapter.to_wire()
        delta_wire = None if delta is None else delta.to_wire()

        def install() -> WorkerAnswer:
            if tensors is not None:
                answer = summarize(self.llm.collective_rpc(calls.INSTALL_TENSORS,
                                                           args=(tensors, int(version), wire, delta_wire)))
            else:
                answer = self._rpc_now(calls.LoadDir(path=str(path), version=int(version), adapter=adapter,
                                                     delta=delta))
            if not answer.ok:
                return answer
            if not self.llm.reset_prefix_cache(reset_running_requests=self.partial_rollouts):
                return WorkerAnswer.failed("installed, but vLLM kept KV blocks of the previous weights (prefix "
                                           "cache reset refused)")
            self.llm.llm_engine.set_weight_version(str(int(version)))
            return answer

        return transport, self._loop.run(install), nbytes

    def _stage(self, weights: Any, version: int) -> tuple[str, list | None, Path | None, Any, Any, int]:
        """(transport, tensors handed over in memory or None, directory or None, adapter spec or None, delta spec or
        None, bytes)."""
        weights, adapter = adapters.split_payload(weights)
        weights, delta = deltas.split_payload(weights)
        if adapter is not None and self.lora is None:
            raise ValueError(f"update_weights version {version}: an adapter, but this engine was started without "
                             "lora (start it with the adapter's spec: lora.sync=adapter)")
        if isinstance(weights, (str, Path)):
            return "disk", None, Path(weights).resolve(), adapter, delta, 0
        if self.in_process:
            tensors = [t for bucket in weights for t in bucket]
            return "memory", tensors, None, adapter, delta, sum(t.numel() * t.element_size() for _, t in tensors)
        path, stats = weights_dir.write_version_dir(
            weights_dir.version_dir(self._tmp.name, version), weights, version, overwrite=True
        )
        return "disk", None, path, adapter, delta, stats["bytes"]

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, ProbeResult]:
        """The engine's version and prompt log-probs of ``token_ids``."""
        from vllm.sampling_params import SamplingParams as VllmParams

        params = VllmParams(n=1, max_tokens=1, temperature=0.0, logprobs=0, prompt_logprobs=0, detokenize=False)
        output = self._loop.generate([list(token_ids)], [params])[0]
        values = [float(output.prompt_logprobs[t][token_ids[t]].logprob) for t in range(1, len(token_ids))]
        spans = [{"version": s.version} for s in output.outputs[0].weight_versions or []]
        return {self.name: ProbeResult(parse_version(spans, "probe"), values)}

    def close(self) -> None:
        """Shut the engine down and drop temporary refresh directories."""
        if getattr(self, "_loop", None) is not None:
            self._loop.close()
            self._loop = None
        if getattr(self, "llm", None) is not None:
            self.llm.shutdown()
            self.llm = None
        self._tmp.cleanup()
