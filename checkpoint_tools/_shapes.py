"""Shapes of a Qwen model's HF tensors, known from its config before any data is read (what streaming writers declare
in their headers, and what the fleet checks a refresh against)."""

from __future__ import annotations

from typing import Any

from checkpoint_tools._mapping import hf_names
from megatron_offgrpo.model import QwenArch, arch_from_hf_config


def hf_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor of ``arch``, in ``hf_names`` order (known before any data is read)."""
    h, d = arch.hidden_size, arch.head_dim
    inter = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size  # per expert for MoE
    q, kv = arch.num_heads * d, arch.num_kv_heads * d
    by_suffix = {
        "embed_tokens.weight": (arch.vocab_size, h), "lm_head.weight": (arch.vocab_size, h), "norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (q, h), "k_proj.weight": (kv, h), "v_proj.weight": (kv, h),
        "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "q_norm.weight": (d,), "k_norm.weight": (d,),
        "o_proj.weight": (h, q), "gate_proj.weight": (inter, h), "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter), "gate.weight": (arch.num_experts, h),
    }
    return {name: by_suffix[".".join(name.split(".")[-2:])] for name in hf_names(arch)}


def expected_hf_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the model described by ``hf_config`` -> its shape (tied lm_head excluded)."""
    return hf_shapes(arch_from_hf_config(hf_config))

