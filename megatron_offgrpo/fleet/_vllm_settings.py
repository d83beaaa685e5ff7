"""The vLLM engine settings the project runs with, built once and rendered two ways: as ``vllm.EngineArgs`` fields
for the in-process engine (``rollout.VLLMEngine``) and as the API server's flags for a fleet server
(``server_command``). Both engines then generate, score and refresh alike: one place decides each setting and says
why, and a test parses the flags with vLLM's own argument parser and compares them with the fields.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal

from megatron_offgrpo.fleet._runner import POOLER_CONFIG, Runner
from megatron_offgrpo.fleet._server_size import cpu_prefill_limits
from megatron_offgrpo.transports import adapters, calls

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")
"""Any of these in a model directory: vLLM can load its tokenizer (without any, it must skip the tokenizer)."""

Routing = Literal["off", "vllm", "hooks"]
"""How a MoE model's routing reaches the samples (router replay): not at all; returned by vLLM with each answer (its
GPU model runner); recorded by the worker's hooks (vLLM CPU), which needs eager execution and no prefix caching."""


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    """One engine's settings.

    Attributes:
        model: the HF model directory it serves. dtype: vLLM's dtype name. max_model_len: longest prompt +
            completion. max_num_seqs: sequences decoded at once. kv_cache_bytes: the KV cache, explicit (vLLM's
            default takes a fraction of the device, or of the host's RAM on CPU, whatever the model needs).
        enforce_eager: no graphs or compilation. routing: see ``Routing``.
        skip_tokenizer_init: requests are token ids in and out; vLLM loads no tokenizer (a directory without one,
            or the in-process engine, which stops on the end-of-sequence id itself).
        cpu_batched_tokens: on CPU, chunked prefill off and this many tokens a step (``cpu_prefill_limits``: a
            seeded request's split prefill would crash the engine); None on a GPU.
        logprobs_mode: the sampled tokens' log-probs: of the distribution actually sampled from (after temperature),
            which the importance ratio needs ("processed_logprobs"), or of the raw model.
        lora: the policy's LoRA adapter (``lora.sync=adapter``): vLLM's LoRA on, one adapter slot of its rank
            (``adapters.SLOT_ID``, never evicted: ``max_loras = max_cpu_loras = 1``); None: no LoRA.
        runner: ``generate``, or ``pooling`` for a sequence classifier (a reward model), whose score is its raw
            logit (``POOLER_CONFIG``: vLLM's sigmoid off).
    """

    model: Path
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_bytes: int
    enforce_eager: bool = True
    routing: Routing = "off"
    skip_tokenizer_init: bool = False
    cpu_batched_tokens: int | None = None
    logprobs_mode: str = "processed_logprobs"
    lora: adapters.AdapterSpec | None = None
    runner: Runner = "generate"

    @classmethod
    def build(cls, model: str | Path, dtype: str, max_model_len: int, max_num_seqs: int, kv_cache_bytes: int, *,
              on_gpu: bool, record_routing: bool = False, enforce_eager: bool = True,
              skip_tokenizer_init: bool | None = None, logprobs_mode: str = "processed_logprobs",
              lora: adapters.AdapterSpec | None = None, runner: Runner = "generate") -> VllmSettings:
        """The settings of an engine on ``model``; ``skip_tokenizer_init`` None: skip it where the directory has no
        tokenizer files.

        Raises:
            ValueError: routing recorded by hooks (``record_routing`` on CPU) without eager execution; a pooling
                runner with routing or LoRA (a classifier generates nothing and is never refreshed), or without a
                tokenizer.
        """
        model = Path(model).resolve()
        routing: Routing = "off" if not record_routing else "vllm" if on_gpu else "hooks"
        if routing == "hooks" and not enforce_eager:
            raise ValueError("record_routing on vLLM CPU needs enforce_eager (the routing hooks do not run in graphs)")
        if runner == "pooling" and (record_routing or lora is not None):
            raise ValueError("a pooling runner (a classifier) serves no LoRA adapter and records no routing")
        if skip_tokenizer_init is None:
            skip_tokenizer_init = not any((model / name).is_file() for name in TOKENIZER_FILES)
        if runner == "pooling" and skip_tokenizer_init:  # vLLM's /classify builds its scorer from the tokenizer
            raise ValueError(f"{model}: a classifier is served with its tokenizer (vLLM's pooling endpoints load it): "
                             f"put its tokenizer files ({', '.join(TOKENIZER_FILES)}) in the directory")
        return cls(model, dtype, max_model_len, max_num_seqs, kv_cache_bytes, enforce_eager, routing,
                   skip_tokenizer_init, None if on_gpu else cpu_prefill_limits(max_model_len)[1], logprobs_mode, lora,
                   runner)

    def engine_args(self) -> dict[str, object]:
        """The settings as ``vllm.EngineArgs`` fields (``vllm.LLM(**...)``)."""
        args: dict[str, object] = dict(
            model=str(self.model), dtype=self.dtype, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            kv_cache_memory_bytes=self.kv_cache_bytes, worker_extension_cls=calls.WORKER_EXTENSION,
            logprobs_mode=self.logprobs_mode, enforce_eager=self.enforce_eager,
            skip_tokenizer_init=self.skip_tokenizer_init,
            # a request's priority orders admission when the batch is full (async: the oldest step first); with every
            # priority equal, first come, first served, as vLLM's default policy
            scheduling_policy="priority")
        if self.cpu_batched_tokens is not None:
            args.update(enable_chunked_prefill=False, max_num_batched_tokens=self.cpu_batched_tokens)
        if self.routing == "vllm":
            args["enable_return_routed_experts"] = True
        elif self.routing == "hooks":
            args["enable_prefix_caching"] = False  # a cached prompt is computed by another request
        if self.lora is not None:
            args.update(enable_lora=True, max_lora_rank=self.lora.vllm_max_rank(), max_loras=1, max_cpu_loras=1)
        if self.runner == "pooling":
            args.update(runner="pooling", pooler_config=dict(POOLER_CONFIG))
        return args

    def server_argv(self) -> list[str]:
        """The same settings as flags of vLLM's API server (``vllm.entrypoints.openai.api_server``)."""
        argv = ["--model", str(self.model), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                "--worker-extension-cls", calls.WORKER_EXTENSION, "--logprobs-mode", self.logprobs_mode,
                "--scheduling-policy", "priority"]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.skip_tokenizer_init:
            argv.append("--skip-tokenizer-init")
        if self.cpu_batched_tokens is not None:
            argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(self.cpu_batched_tokens)]
        if self.routing == "vllm":
            argv.append("--enable-return-routed-experts")
        elif self.routing == "hooks":
            argv.append("--no-enable-prefix-caching")
        if self.lora is not None:
            argv += ["--enable-lora", "--max-lora-rank", str(self.lora.vllm_max_rank()), "--max-loras", "1",
                     "--max-cpu-loras", "1"]
        if self.runner == "pooling":
            argv += ["--runner", "pooling", "--pooler-config", json.dumps(POOLER_CONFIG)]
        return argv
