"""The transformer layer spec: Transformer Engine's when TE is usable, megatron-core's local modules otherwise.

Decided once by ``have_te()`` (megatron's ``HAVE_TE`` habit). Parameter names differ between the two specs (TE
fuses the pre-attention and pre-MLP RMSNorm weights into ``linear_qkv`` / ``linear_fc1`` as
``layer_norm_weight``); ``checkpoint_tools`` maps both. The local spec's core attention is ``SdpaAttention``
(``_sdpa.py``): no parameters, so the names are megatron's; its norms are ``QwenRMSNorm`` (``_norm.py``), torch's
RMSNorm that also runs under sequence parallelism.
"""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_offgrpo.runtime import have_te


def qwen_layer_spec(qk_norm: bool, use_te: bool | None = None, num_experts: int = 0) -> ModuleSpec:
    """The decoder layer spec for a Qwen model.

    Args:
        qk_norm: add RMSNorm on query and key heads (Qwen3).
        use_te: force the TE (True) or local (False) spec; ``None`` picks TE when it is usable.
        num_experts: > 0 for a mixture-of-experts MLP (Qwen3-MoE): TE's grouped-GEMM experts under the TE spec,
            megatron's ``SequentialMLP`` (one local MLP per expert, torch GEMMs) under the local spec.

    Raises:
        RuntimeError: ``use_te=True`` on a machine where Transformer Engine cannot be used.
    """
    if use_te is None:
        use_te = have_te()
    if use_te:
        if not have_te():
            from megatron_offgrpo.runtime import te_status

            raise RuntimeError(f"the Transformer Engine layer spec was requested but {te_status()[1]}")
        return get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts or None,
                                                          moe_grouped_gemm=num_experts > 0, qk_layernorm=qk_norm)
    from megatron_offgrpo.model._norm import QwenRMSNorm
    from megatron_offgrpo.model._sdpa import SdpaAttention

    spec = get_gpt_layer_local_spec(num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_norm,
                                    normalization="RMSNorm")
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = SdpaAttention
    # megatron's torch norm refuses sequence parallelism; the final norm is the block's (``local_block_spec``)
    layer.input_layernorm = layer.pre_mlp_layernorm = QwenRMSNorm
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = QwenRMSNorm
    if num_experts:
        # megatron-core's local spec checkpoints every layer's pre-MLP norm under TE's fused name
        # (``mlp.linear_fc1.layer_norm_weight``), but a TE MoE layer keeps its own ``pre_mlp_layernorm`` (a TENorm:
        # its MLP has no linear_fc1). Under megatron's map, a MoE checkpoint written on GPUs and one written here
        # would not read each other; the input norm's entry stays (TE fuses it into linear_qkv in both).
        spec.submodules.sharded_state_dict_keys_map = {
            local: saved for local, saved in spec.submodules.sharded_state_dict_keys_map.items()
            if local != "pre_mlp_layernorm."}
    return spec


def local_block_spec(layer_spec: ModuleSpec, config) -> TransformerBlockSubmodules:
    """The decoder block of this stage for a local ``layer_spec``: its layers, and ``QwenRMSNorm`` as the final norm
    (megatron's default block takes the final norm from its module-level choice, torch's norm without apex or TE).

    Args:
        layer_spec: from ``qwen_layer_spec(..., use_te=False)``. config: the ``TransformerConfig`` (this stage's
            number of layers follows from it and the pipeline rank, as megatron counts them).
    """
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    from megatron_offgrpo.model._norm import QwenRMSNorm

    return TransformerBlockSubmodules(layer_specs=[layer_spec] * get_num_layers_to_build(config),
                                      layer_norm=QwenRMSNorm)
