"""What a fleet server is started with, derived from its model's HF config: sequence length, dtype, KV cache bytes.

vLLM's own defaults fail on small models and mislead on big ones: its default ``max_model_len`` (2048) exceeds a
model with fewer positions (the tiny default has 512), ``--dtype auto`` serves a float32 checkpoint in bfloat16 (the
fleet's log-probs then disagree with an fp32 trainer's and the refresh verification fails), and a KV cache taken as
a fraction of the memory says nothing about how many sequences fit. So the launcher passes all three explicitly.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import psutil

from megatron_offgrpo.fleet._kv_cache import kv_cache_bytes

GIB = 1 << 30
BLOCK_TOKENS = 256
"""Sequence lengths are counted in whole blocks of this many tokens (the largest KV block vLLM uses, on CPU), so a
sequence of ``max_model_len`` tokens fits whatever block size the backend picks."""
DEFAULT_BATCHED_TOKENS = 2048  # vLLM's default max_num_batched_tokens (SchedulerConfig)


def model_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype the checkpoint was saved in (``torch_dtype``, or ``dtype`` in newer transformers); "auto" if neither.

    Serving in it keeps the fleet's log-probs those of the trainer's weights: float32 stays float32.
    """
    return str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "auto").removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class ServerSize:
    """What one server is started with.

    Attributes:
        max_model_len: longest prompt + completion (vLLM ``--max-model-len``).
        dtype: vLLM ``--dtype``.
        max_num_seqs: sequences decoded at once (vLLM ``--max-num-seqs``).
        kv_cache_bytes: KV cache of the server, per GPU with tp > 1 (vLLM ``--kv-cache-memory-bytes``).
    """

    max_model_len: int
    dtype: str
    max_num_seqs: int
    kv_cache_bytes: int

    def describe(self) -> str:
        """One line for the console."""
        return (
            f"max_model_len {self.max_model_len}, dtype {self.dtype}, max_num_seqs {self.max_num_seqs}, "
            f"KV cache {self.kv_cache_bytes / GIB:.2f} GiB per server"
        )


def cpu_prefill_limits(max_model_len: int) -> tuple[bool, int]:
    """(``enable_chunked_prefill``, ``max_num_batched_tokens``) for a vLLM engine on CPU: chunked prefill off, and a
    step's token budget large enough for any prompt whole.

    Why: vLLM rewinds a seeded request's generator when it drops the token sampled after a partial prefill
    (``gen.set_offset(gen.get_offset() - 4)`` in its model runner), and a CPU ``torch.Generator`` has no offset: the
    engine dies ("CPU Generator does not use offset") as soon as a seeded request's prompt is split over two steps,
    e.g. under ``rollout.mode=async``'s many requests at once, or a partial-rollouts refresh's recomputation. Without
    chunked prefill a prompt is scheduled whole or waits, so no sampled token is ever dropped.
    """
    return False, max(max_model_len, DEFAULT_BATCHED_TOKENS)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def size_server(
    hf_config: dict[str, Any],
    max_model_len: int | None,
    dtype: str | None,
    max_num_seqs: int,
    kv_cache_gib: float | None = None,
    tp: int = 1,
) -> ServerSize:
    """The size of one server: each argument given wins, each left None comes from the model.

    Args:
        hf_config: the model's ``config.json``.
        max_model_len: None: the model's ``max_position_embeddings``.
        dtype: None: the model's ``torch_dtype`` (``model_dtype``).
        max_num_seqs: sequences decoded at once.
        kv_cache_gib: None: ``kv_cache_bytes`` for ``max_num_seqs`` sequences of ``max_model_len`` tokens (whole
            ``BLOCK_TOKENS`` blocks), split over ``tp`` GPUs as vLLM splits the KV heads.
        tp: GPUs per server.

    Raises:
        ValueError: no length given and none in the config.
    """
    if max_model_len is None:
        if "max_position_embeddings" not in hf_config:
            raise ValueError("config.json has no max_position_embeddings: give --max-model-len")
        max_model_len = int(hf_config["max_position_embeddings"])
    dtype = dtype or model_dtype(hf_config)
    if kv_cache_gib:
        kv = int(kv_cache_gib * GIB)
    else:
        tokens = -(-max_model_len // BLOCK_TOKENS) * BLOCK_TOKENS
        kv_heads = int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])
        # each rank holds kv_heads // tp heads (one replicated head when tp exceeds them)
        kv = kv_cache_bytes(hf_config, tokens, max_num_seqs, dtype) * max(1, kv_heads // tp) // kv_heads
    return ServerSize(max_model_len=max_model_len, dtype=dtype, max_num_seqs=max_num_seqs, kv_cache_bytes=kv)


def available_memory_bytes() -> int | None:
    """This machine's available memory (Linux's MemAvailable: RAM the kernel can give without swapping), or None
    where unknown."""
    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError):
        return None


def fit_errors(size: ServerSize, servers: int, room_bytes: int | None, room: str, derived_len: bool) -> list[str]:
    """Why ``servers`` KV caches of ``size`` do not fit in ``room_bytes`` (named ``room``); [] when they do or the room
    is unknown. ``derived_len``: ``max_model_len`` came from the model (the message says so)."""
    need = servers * size.kv_cache_bytes
    if room_bytes is None or need <= room_bytes:
        return []
    origin = ", the model's max_position_embeddings" if derived_len else ""
    return [
        f"KV cache {servers} x {size.kv_cache_bytes / GIB:.2f} GiB = {need / GIB:.1f} GiB > {room} "
        f"{room_bytes / GIB:.1f} GiB: lower --max-model-len (now {size.max_model_len}{origin}; a recipe needs "
        f"data.max_prompt_tokens + rollout.max_new_tokens) or --max-num-seqs (now {size.max_num_seqs}), "
        "or give --kv-cache-gib"
    ]
