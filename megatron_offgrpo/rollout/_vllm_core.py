"""``VllmCore``: vLLM's ``LLMEngine`` with the three calls the in-process engine makes of ``vllm.LLM``, without it.

``vllm.LLM`` is vLLM's offline entry point: importing it imports chat, pooling, scoring and the OpenAI and MCP
protocols, and starting it renders a chat-template warm-up (with a tokenizer) or logs a warning and its traceback
(without one). The in-process engine uses none of that: its requests are token ids in and out. Building the engine
itself, with ``vllm.LLM``'s defaults, and queueing token prompts as the engine's own input type takes those seconds
off every start (``benchmarks/startup.py``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Any, Iterator, Sequence


class VllmCore:
    """A ``vllm.v1.engine.llm_engine.LLMEngine`` (``llm_engine``) and the calls ``VLLMEngine`` needs of it."""

    def __init__(self, lora_request: Any = None, **engine_args: Any) -> None:
        """Start the engine; ``engine_args`` are ``vllm.EngineArgs`` fields (``model``, ``dtype``, ...);
        ``lora_request``: the ``vllm.lora.request.LoRARequest`` every request is served with (None: the base)."""
        from vllm import envs
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        engine_args = {"seed": 0, "disable_log_stats": True, **engine_args}  # vllm.LLM's defaults
        config = EngineArgs(**engine_args).create_engine_config(UsageContext.LLM_CLASS)
        multiprocess = bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING)
        self.llm_engine = LLMEngine(vllm_config=config, executor_class=_executor_class(config, multiprocess),
                                    log_stats=False, usage_context=UsageContext.LLM_CLASS,
                                    multiprocess_mode=multiprocess)
        self._ids = itertools.count()
        self.lora_request = lora_request

    def add(self, prompts: Sequence[Sequence[int]], params: Sequence[Any], priority: int) -> list[str]:
        """Queue one request per prompt (token ids) with its sampling params, admitted by ``priority`` (lower first);
        the ids their outputs carry, in order. All or none: a request refused aborts the ones queued before it."""
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        ids, internal = [], []
        try:
            for prompt, sampling in zip(prompts, params, strict=True):
                sampling.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it is done
                ids.append(str(next(self._ids)))
                internal.append(self.llm_engine.add_request(ids[-1], tokens_input(list(prompt)), sampling,
                                                            lora_request=self.lora_request, priority=priority))
        except Exception:
            if internal:
                self.llm_engine.abort_request(internal, internal=True)
            raise
        return ids

    def collective_rpc(self, method: str | Any, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``method`` on every worker (a worker-extension method's name, or a callable taking the worker)."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop the cached KV blocks (with ``reset_running_requests``, the running requests' too: they are recomputed);
        False when the engine refused."""
        return self.llm_engine.reset_prefix_cache(reset_running_requests, False)

    def shutdown(self) -> None:
        """Stop the engine core and free its KV cache; on CPU without vLLM's two full garbage collections.

        vLLM's shutdown runs ``gc.collect()`` in its KV-cache clean-up and again in its distributed clean-up, so that
        GPU memory held by reference cycles returns before ``empty_cache``. Each walks every object of the process
        (torch, megatron-core, transformers and vLLM loaded: about a second each on the 2-core CI machine), and on CPU
        they buy nothing: the KV cache is host memory that reference counting frees as vLLM drops it, and a cycle left
        over is collected by Python's own next collection. The in-process engine closes at the end of every run.
        """
        from vllm.platforms import current_platform

        shutdown = self.llm_engine.engine_core.shutdown  # the client: in process, or the engine core's process
        if not current_platform.is_cpu():
            shutdown()
            return
        with _full_collections_skipped():
            shutdown()


@contextlib.contextmanager
def _full_collections_skipped() -> Iterator[None]:
    """``gc.collect()`` does nothing inside (Python's automatic collections go on): see ``VllmCore.shutdown``."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


def _executor_class(config: Any, multiprocess: bool) -> type:
    """vLLM's executor for ``config``; on CPU, one worker in the engine core's own process when that is a process of
    its own (under torchrun).

    vLLM's CPU platform turns a one-worker engine's executor into its multiprocess one whenever the engine core runs
    in a process of its own, because the worker's OpenMP set-up must happen in a fresh process: that engine core
    process is one. The multiprocess executor adds a third process (vLLM, torch and the model imported again,
    seconds of CPU at every start) and a shared-memory queue whose reader spins for a second after every message,
    on the cores the trainer's ranks share.
    """
    from vllm.platforms import current_platform
    from vllm.v1.executor import Executor
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    if multiprocess and current_platform.is_cpu() and config.parallel_config.world_size == 1:
        config.parallel_config.distributed_executor_backend = "uni"
        return UniProcExecutor
    return Executor.get_class(config)
