"""How much KV cache a vLLM engine needs, computed from the run instead of from the machine's free memory.

vLLM sizes its KV cache by default as a fraction of the device's memory minus what the process already holds (on
CPU: of the NUMA node's RAM minus this process's RSS). An in-process engine shares its process with the trainer,
so that answer depends on the NUMA layout and the trainer's footprint of the moment, and it fails on machines
where the trainer is large or node 0 is small. A run knows what it needs: every sequence it generates at once at
the model's length, times the bytes one token's keys and values take in every layer. That, with a floor for
vLLM's own block granularity, is what every engine of ours asks for (``kv_cache_memory_bytes``).
"""

from __future__ import annotations

from typing import Any, Mapping

KV_FLOOR_BYTES = 64 * 1024**2
"""The least any engine asks for: a few blocks of every layer even for the tiniest model."""
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2}


def kv_bytes_per_token(hf_config: Mapping[str, Any], dtype: str) -> int:
    """Bytes of one token's keys and values over every layer (2 x layers x kv_heads x head_dim x dtype bytes).

    Args:
        hf_config: the model's HF ``config.json`` as a dict.
        dtype: the engine's dtype ("float32", "bfloat16", ...; "auto" counts as 4 bytes, the widest).
    """
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    # vLLM's Qwen2 takes hidden_size // heads; Qwen3 an explicit head_dim: the larger of the two never undercounts.
    head_dim = max(int(hf_config.get("head_dim") or 0), int(hf_config["hidden_size"]) // heads)
    return 2 * int(hf_config["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES.get(str(dtype), 4)


def kv_cache_bytes(
    hf_config: Mapping[str, Any], max_model_len: int, max_seqs: int, dtype: str, floor: int = KV_FLOOR_BYTES
) -> int:
    """The KV cache an engine needs to hold ``max_seqs`` sequences of ``max_model_len`` tokens at once.

    Args:
        hf_config: the model's HF ``config.json`` as a dict. max_model_len: longest prompt + completion.
        max_seqs: sequences generated at once (vLLM's ``max_num_seqs``). dtype: the engine's dtype.
        floor: the least returned.

    Raises:
        ValueError: a non-positive length or sequence count.
    """
    if max_model_len < 1 or max_seqs < 1:
        raise ValueError(f"kv_cache_bytes: max_model_len={max_model_len} and max_seqs={max_seqs} must be >= 1")
    return max(floor, max_seqs * max_model_len * kv_bytes_per_token(hf_config, dtype))
