"""Build one pipeline stage of a megatron-core ``GPTModel`` for a Qwen architecture."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer import TransformerConfig

from megatron_offgrpo.model._arch import QwenArch
from megatron_offgrpo.model._rope import use_position_ids
from megatron_offgrpo.model._spec import local_block_spec, qwen_layer_spec


def transformer_config(
    arch: QwenArch,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_cpu_initialization: bool | None = None,
    perform_initialization: bool = True,
    ep: int = 1,
    moe_aux_loss_coef: float | None = None,
    use_te: bool | None = None,
    routing_replay: bool = False,
    etp: int | None = None,
    sequence_parallel: bool | None = None,
) -> TransformerConfig:
    """The megatron ``TransformerConfig`` that computes the same function as the HF model of ``arch``.

    Fusions and dropout are off: they either need CUDA kernels or change the function (RL log-probs must match
    the generator's). Mixed precision other than the params' dtype (FP8) is configured by ``model.precision``.
    MoE archs also get ``ep`` (expert parallelism), the load-balancing loss weight (``None``: the HF config's
    ``router_aux_loss_coef``) and grouped-GEMM experts when the TE spec is used (``use_te``, as ``build_gpt_stage``);
    ``routing_replay`` builds routers that can replay given experts (``train._step.replay_routing``); ``etp`` splits
    each expert over that many ranks (None: tp). ``sequence_parallel``: megatron's sequence parallelism
    (``resolve_sequence_parallel``; None: on for MoE archs at tp > 1, which megatron trains only with it).
    """
    arch.check_layout(tp, pp, ep, etp)
    if use_cpu_initialization is None:
        use_cpu_initialization = not torch.cuda.is_available()
    return TransformerConfig(
        sequence_parallel=resolve_sequence_parallel(arch, tp, sequence_parallel),
        **_moe_fields(arch, ep, moe_aux_loss_coef, use_te, routing_replay, etp),
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.initializer_range,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def resolve_sequence_parallel(arch: QwenArch, tp: int, requested: bool | None) -> bool:
    """Whether a model of ``arch`` at ``tp`` runs with sequence parallelism (``parallel.sequence_parallel``).

    None picks it for MoE archs at tp > 1: megatron's MoE layer raises at the first training forward with tp > 1
    without it (every TP rank would route the same tokens). Dense models keep it off unless asked: it saves
    activation memory at the cost of an all-gather / reduce-scatter pair per layer in place of an all-reduce.
    """
    return (arch.is_moe and tp > 1) if requested is None else requested


def _moe_fields(arch: QwenArch, ep: int, aux_loss_coef: float | None, use_te: bool | None,
                routing_replay: bool, etp: int | None) -> dict:
    """The MoE part of the config (empty for dense archs): HF Qwen3-MoE routing, expressed in megatron's terms."""
    if not arch.is_moe:
        return {}
    from megatron_offgrpo.runtime import have_te

    coef = arch.router_aux_loss_coef if aux_loss_coef is None else aux_loss_coef
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        # HF: softmax over all experts, top-k, then (norm_topk_prob) renormalise. Renormalised, that equals
        # megatron's top-k of the logits then softmax over them (pre_softmax=False); without renormalisation it is
        # megatron's softmax-then-top-k (pre_softmax=True).
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",  # HF computes the routing softmax in fp32 whatever the params' dtype
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=have_te() if use_te is None else use_te,
        moe_permute_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        moe_enable_routing_replay=routing_replay,
    )


def build_gpt_stage(
    arch: QwenArch,
    config: TransformerConfig,
    pre_process: bool,
    post_process: bool,
    use_te: bool | None = None,
) -> GPTModel:
    """One pipeline stage of the Qwen model (the whole model when pp == 1).

    Args:
        arch: the architecture. config: from ``transformer_config``.
        pre_process: this stage holds the embedding (first stage).
        post_process: this stage holds the final norm and output layer (last stage).
        use_te: see ``qwen_layer_spec``.
    """
    if use_te is None:
        from megatron_offgrpo.runtime import have_te

        use_te = have_te()
    spec = qwen_layer_spec(arch.qk_norm, use_te, arch.num_experts)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec if use_te else local_block_spec(spec, config),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rotary_percent=1.0,
    )
    # packed and shared-prompt rows: rotary angles from each token's position id, not its place in the row (_rope.py)
    use_position_ids(model)
    _mark_replicated_experts(model, config)
    # Megatron's parallel linears allocate on the current GPU themselves, but the local spec's norms (torch
    # fallbacks without apex) are built on the host: move the whole stage, as megatron's own get_model does.
    on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
    return model.to(device=torch.cuda.current_device() if on_gpu else "cpu", dtype=config.params_dtype)


def _mark_replicated_experts(model: GPTModel, config: TransformerConfig) -> None:
    """Send the expert grads to megatron DDP's expert-data-parallel reduction when experts are split unlike TP
    without expert parallelism (etp < tp, ep = 1: e.g. whole experts on both ranks of a TP2 group).

    Megatron marks an expert weight for that reduction only when ep > 1 (``allreduce = not (is_expert and
    expert_parallel)`` in its parallel linears); otherwise DDP reduces it like a dense weight, over the data-parallel
    group. That is the same group when etp == tp. With etp < tp it is not: under sequence parallelism each TP rank
    routes its own positions through its copy of the experts, so the copies' grads are partial sums over those
    positions and must be summed over the expert-DP group (which spans the TP ranks), as they are with ep > 1.
    """
    if not config.num_moe_experts or config.expert_model_parallel_size > 1:
        return
    if config.expert_tensor_parallel_size == config.tensor_model_parallel_size:
        return
    for name, param in model.named_parameters():
        if ".experts." in name:
            param.allreduce = False


def _hidden_passthrough(hidden_states, weight=None, runtime_gather_output=None, sequence_parallel=False):
    if sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # [s/tp, b, H] -> [s, b, H]. The fused loss all-reduces its hidden-state gradient over TP itself (every rank
        # then holds the whole, identical gradient), so the backward takes this rank's rows of it (a split), where
        # megatron's output layer, whose GEMM leaves each rank a partial gradient, reduce-scatters.
        hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
    return hidden_states, None


def expose_hidden_states(model: GPTModel) -> GPTModel:
    """Make the last stage return final-norm hidden states ``[b, s, H]`` instead of logits.

    The fused loss takes hidden states and the output weight itself, so the ``[tokens, vocab]`` logits are never
    built. Only the output layer's ``forward`` is replaced on this instance: its weight stays registered (DDP,
    optimizer, checkpoints and the tied-embedding sync are unchanged), and megatron's own post-processing still
    transposes to batch-first. Under sequence parallelism the hidden states of the whole row are gathered first, as
    megatron's output layer does, so every TP rank gets all ``s`` positions. Idempotent.
    """
    if model.post_process:
        model.output_layer.forward = functools.partial(_hidden_passthrough,
                                                       sequence_parallel=model.config.sequence_parallel)
    return model


def output_weight(model: GPTModel):
    """This rank's output-layer shard ``[V/tp, H]``: the tied embedding or the separate head (last stage only)."""
    if not model.post_process:
        raise ValueError("output_weight: only the last pipeline stage holds the output layer")
    return (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
            else model.output_layer.weight)
