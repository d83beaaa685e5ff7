"""Greedy continuations from fresh in-process vLLM engines, one per model directory (a subprocess of the rollout
tests: vLLM's CPU worker patches process-wide torch settings, which must not leak into the pytest process).

Usage: python rollout_fresh_vllm.py OUT.json PROMPTS.json MAX_TOKENS DIR [DIR ...]
Writes {dir: [[token ids] per prompt]} to OUT.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    from megatron_offgrpo.data import Prompt, SamplingParams
    from megatron_offgrpo.rollout import VLLMEngine

    out, prompts_file, max_tokens, *dirs = sys.argv[1:]
    prompts = [Prompt(p["id"], tuple(p["ids"])) for p in json.loads(open(prompts_file).read())]
    result = {}
    for directory in dirs:
        engine = VLLMEngine(directory, dtype="float32", max_model_len=512)
        result[directory] = [s.response_ids for s in engine.generate(
            prompts, 1, SamplingParams(max_tokens=int(max_tokens), temperature=0.0))]
        engine.close()
        del engine
        gc.collect()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
