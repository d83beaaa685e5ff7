"""Whether this machine's vLLM can serve a model, asked of vLLM itself before its engine starts.

vLLM CPU builds its engine for any head size, and its attention kernel refuses an unsupported one only inside the
first forward pass (``Unsupported CPU attention configuration: head_dim=16``), where the run has nothing to fall back
on. Its CPU attention backend lists the head sizes it has kernels for: asked here, not copied. On GPUs vLLM picks (or
refuses) an attention backend while its engine starts, which the ``auto`` fall-back already catches.
"""

from __future__ import annotations

import logging


def head_size(hf_config: dict) -> int:
    """The attention head size vLLM serves ``hf_config`` with: ``head_dim`` when given (Qwen3), else hidden / heads."""
    explicit = hf_config.get("head_dim")
    return int(explicit) if explicit else hf_config["hidden_size"] // hf_config["num_attention_heads"]


def unservable_reason(hf_config: dict) -> str | None:
    """Why vLLM here cannot serve ``hf_config``, or None (on a GPU, or when this vLLM does not say: its engine start
    or first generation then decides). Imports vLLM."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return None
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
        fits = CPUAttentionBackend.supports_head_size(head_size(hf_config))
    except (ImportError, AttributeError) as exc:  # a vLLM laid out otherwise: no answer, not a refusal
        logging.getLogger(__name__).info("vLLM's CPU attention head sizes unknown (%s): not checked", exc)
        return None
    if fits:
        return None
    return (f"vLLM's CPU attention has no kernel for head_dim={head_size(hf_config)} (it supports "
            f"{sorted(supported)})")
