"""Transformer Engine layer-spec names (issue 31): a TE-spec model's state dicts (norms fused into the linears,
grouped experts, ``_extra_state`` entries) go to HF and back bit-exactly at TP1/TP2 (and EP2 for Qwen3-MoE), dense,
with q/k norm and MoE; ``_extra_state`` is skipped on the way to HF and written only under the model's own keys.

TE does not import on a CPU machine, so ``te_layout`` derives the TE model's state-dict layout from the local-spec
model (real megatron-core) and megatron-core 0.16.1's TE spec; ``test_te_layout_equals_the_real_te_model`` (GPU, TE)
checks it against the real TE-spec model.
"""

from __future__ import annotations

import pickle
import re
from typing import Mapping

import pytest
import torch

from checkpoint_tools import load_hf_into_stage, open_safetensors_dir, stream_hf_buckets
from checkpoint_tools._live import is_extra_state
from checkpoint_tools._mapping import UnknownTensorError, hf_names
from checkpoint_tools._state_dict import hf_to_state_dict, state_dicts_to_hf
from megatron_offgrpo.model import QwenArch, build_gpt_stage, load_arch, transformer_config

CASES = {"qwen2": ("hf_models", "qwen2_untied"), "qwen3_qk_norm": ("hf_models", "qwen3_tied"),
         "qwen3_moe": ("moe_models", "qwen3_moe")}
LAYOUTS = [("qwen2", 1, 1), ("qwen2", 2, 1), ("qwen3_qk_norm", 1, 1), ("qwen3_qk_norm", 2, 1),
           ("qwen3_moe", 1, 1), ("qwen3_moe", 2, 1), ("qwen3_moe", 1, 2), ("qwen3_moe", 2, 2)]

Slot = tuple[tuple[int, ...], torch.dtype] | None  # shape and dtype of a tensor; None: megatron's placeholder
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# TP split axes, as TE's sharded_state_dict declares them (megatron-core extensions/transformer_engine.py:909-920
# TELayerNormColumnParallelLinear {"weight": 0, "bias": 0}, :1116-1122 TERowParallelLinear {"weight": 1}; the grouped
# linears alike); vocab rows for the embedding and output layer; norms and the router replicated.
_ROWS = re.compile(r"(linear_qkv\.(weight|bias)|linear_fc1\.weight\d*|word_embeddings\.weight|output_layer\.weight)$")
_COLS = re.compile(r"(linear_proj|linear_fc2)\.weight\d*$")


def te_name(local: str, arch: QwenArch) -> str:
    """The TE-spec name of a local-spec parameter (megatron-core 0.16.1, models/gpt/gpt_layer_specs.py):
    - ``get_gpt_layer_with_transformer_engine_spec`` (:271-302) leaves ``input_layernorm`` an ``IdentityOp`` and makes
      ``linear_qkv`` a ``TELayerNormColumnParallelLinear``, whose TE ``LayerNormLinear`` holds the norm as
      ``layer_norm_weight`` (``layer_norm_bias`` only for LayerNorm; Qwen's RMSNorm has none).
    - ``pre_mlp_layernorm`` is ``TENorm`` only with experts (:291, name unchanged); a dense layer's goes into its MLP's
      ``linear_fc1``, a ``TELayerNormColumnParallelLinear`` (``get_mlp_module_spec_for_backend``, :495-496).
    - Grouped GEMM (extensions/transformer_engine_spec_provider.py ``grouped_mlp_modules``): ``TEGroupedMLP`` with
      ``TE{Column,Row}ParallelGroupedLinear``, whose TE ``GroupedLinear`` registers ``weight{j}`` per local expert.
    """
    expert = _EXPERT.match(local)
    if expert:
        return f"{expert[1]}.{expert[3]}.weight{expert[2]}"
    name = local.replace(".input_layernorm.", ".self_attention.linear_qkv.layer_norm_")
    return name if arch.is_moe else name.replace(".pre_mlp_layernorm.", ".mlp.linear_fc1.layer_norm_")


def _shard(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if _ROWS.search(name):
        return (shape[0] // tp, *shape[1:])
    if _COLS.search(name):
        return (shape[0], shape[1] // tp)
    return shape


def te_layout(local: Mapping[str, torch.Tensor | None], arch: QwenArch, tp: int = 1, ep: int = 1) -> dict[str, Slot]:
    """The state-dict layout of one TP x EP rank of the TE-spec ``GPTModel`` (name -> shape, dtype), from the
    ``state_dict()`` of the local-spec model of the same arch at TP1/EP1/PP1.

    Weights: renamed by ``te_name``, split by ``_shard``; an EP rank holds experts ``weight0 .. weight{E/ep-1}``.
    ``_extra_state`` (torch's key for ``get_extra_state``): the local linears' ``None`` placeholders go, and every TE
    module brings its own, an empty uint8 tensor without FP8 (TE module/base.py ``get_extra_state``): the linears,
    ``core_attention`` (TE's ``DotProductAttention`` is a TE base module), each grouped linear once (megatron splits it
    per expert only for dist-ckpt, extensions/transformer_engine.py:1748-1783) and every ``TENorm`` (TE 2.x's RMSNorm is
    an ops ``BasicOperation``, which defines ``get_extra_state``): q/k norms, a MoE layer's pre-MLP norm and the final
    norm (transformer_block.py ``LayerNormImpl = TENorm``). The output layer stays megatron's ``ColumnParallelLinear``
    in both specs, its ``None`` kept (tensor_parallel/layers.py:1072-1077).
    """
    per_rank = arch.num_experts // ep if arch.is_moe else 0
    layout: dict[str, Slot] = {}
    for name, tensor in local.items():
        if is_extra_state(name):
            continue
        expert = _EXPERT.match(name)
        if expert and int(expert[2]) >= per_rank:
            continue  # another EP rank's expert
        te = te_name(name, arch)
        layout[te] = (_shard(te, tuple(tensor.shape), tp), tensor.dtype)
    te_modules = ["decoder.final_layernorm"] if "decoder.final_layernorm.weight" in local else []
    for i in sorted({int(m[1]) for m in map(_LAYER.match, local) if m}):
        att, mlp = f"decoder.layers.{i}.self_attention", f"decoder.layers.{i}.mlp"
        te_modules += [f"{att}.linear_qkv", f"{att}.core_attention", f"{att}.linear_proj"]
        te_modules += [f"{att}.q_layernorm", f"{att}.k_layernorm"] if arch.qk_norm else []
        te_modules += ([f"decoder.layers.{i}.pre_mlp_layernorm", f"{mlp}.experts.linear_fc1",
                        f"{mlp}.experts.linear_fc2"] if arch.is_moe else [f"{mlp}.linear_fc1", f"{mlp}.linear_fc2"])
    layout.update({f"{module}._extra_state": ((0,), torch.uint8) for module in te_modules})
    if "output_layer._extra_state" in local:
        layout["output_layer._extra_state"] = None
    return layout


def describe(state: Mapping[str, torch.Tensor | None]) -> dict[str, Slot]:
    """A state dict's layout (shape and dtype of each entry)."""
    return {k: None if v is None else (tuple(v.shape), v.dtype) for k, v in state.items()}


def _weights(layout: Mapping[str, Slot]) -> dict[str, Slot]:
    return {k: v for k, v in layout.items() if not is_extra_state(k)}


def _build(arch: QwenArch, use_te: bool) -> torch.nn.Module:
    config = transformer_config(arch, 1, 1, use_te=use_te)
    return build_gpt_stage(arch, config, pre_process=True, post_process=True, use_te=use_te)


@pytest.fixture(scope="module")
def local_models(hf_models, moe_models) -> dict[str, tuple[QwenArch, object, torch.nn.Module]]:
    """Each case's local-spec megatron model at TP1 (real megatron-core), loaded from its HF model."""
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    dirs = {"hf_models": hf_models, "moe_models": moe_models}
    init_parallel(1, 1)
    try:
        out = {}
        for case, (group, name) in CASES.items():
            hf_dir = dirs[group][name]
            arch = load_arch(hf_dir)
            model = _build(arch, use_te=False)
            load_hf_into_stage(model, arch, open_safetensors_dir(hf_dir), 1, 0, 1, 0)
            out[case] = (arch, hf_dir, model)
    finally:
        destroy_parallel()
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_local_models_checkpoint_keys_are_the_te_models(local_models, case):
    """What megatron's dist checkpoint stores a weight under (its sharded key: the name, less the layer index) is the
    same for the local model as for the TE model, so a checkpoint written on a GPU (TE) reads here and back. Experts
    are left out: both stacks are stored as ``mlp.experts.experts.linear_fc*`` by megatron itself. Fails on MoE under
    megatron-core's own local spec, which stores the pre-MLP norm under TE's dense name."""
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    arch = local_models[case][0]
    init_parallel(1, 1)
    try:
        stored = {name: item.key for name, item in _build(arch, use_te=False).sharded_state_dict().items()
                  if not is_extra_state(name) and ".experts." not in name}
    finally:
        destroy_parallel()
    assert stored == {name: re.sub(r"\.layers\.\d+\.", ".layers.", te_name(name, arch)) for name in stored}


@pytest.mark.parametrize("case,tp,ep", LAYOUTS, ids=[f"{c}-tp{t}-ep{e}" for c, t, e in LAYOUTS])
def test_te_layout_round_trips_through_hf_bit_exactly(local_models, case, tp, ep):
    arch, hf_dir, model = local_models[case]
    hf = open_safetensors_dir(hf_dir)
    layout = te_layout(model.state_dict(), arch, tp, ep)
    states = [[hf_to_state_dict(hf, arch, layout, tp, t, ep=ep, ep_rank=e) for t in range(tp)] for e in range(ep)]
    for state in (s for by_tp in states for s in by_tp):
        assert list(state) == list(layout)  # every key of the TE model, extra states included, nothing else
        assert _weights(describe(state)) == _weights(layout)
    pairs = list(state_dicts_to_hf(states, arch))
    assert [name for name, _ in pairs] == hf_names(arch)  # every HF tensor exactly once, in the writer's order
    for name, tensor in pairs:
        assert tensor.dtype == hf[name].dtype and torch.equal(tensor, hf[name]), f"{name} changed on the way to HF"
    back = dict(pairs)
    for e, by_tp in enumerate(states):
        for t, state in enumerate(by_tp):
            again = hf_to_state_dict(back, arch, layout, tp, t, ep=ep, ep_rank=e)
            for key, tensor in state.items():
                assert torch.equal(again[key], tensor), f"{key} (tp rank {t}, ep rank {e}) changed on the way back"


@pytest.mark.parametrize("case", list(CASES))
def test_te_state_dict_holds_the_local_models_weights_under_te_names(local_models, case):
    """Values, not only names: at TP1 each TE-spelled tensor is the local model's, loaded by ``load_hf_into_stage``
    (the path every refresh uses), so a norm loaded into the wrong fused linear fails here."""
    arch, hf_dir, model = local_models[case]
    local = model.state_dict()
    state = hf_to_state_dict(open_safetensors_dir(hf_dir), arch, te_layout(local, arch))
    for name, tensor in local.items():
        if not is_extra_state(name):
            assert torch.equal(state[te_name(name, arch)], tensor), f"{name} -> {te_name(name, arch)}"


def test_extra_state_is_skipped_on_the_way_to_hf_and_other_stray_keys_raise(local_models):
    arch, hf_dir, model = local_models["qwen3_qk_norm"]
    state = hf_to_state_dict(open_safetensors_dir(hf_dir), arch, te_layout(model.state_dict(), arch))
    # what TE saves under FP8 (a pickled byte tensor), and megatron's own linears' None
    fp8 = torch.frombuffer(bytearray(pickle.dumps({"recipe": "delayed", "scale_fwd": [1.0]})), dtype=torch.uint8)
    state = {k: fp8 if is_extra_state(k) else v for k, v in state.items()}
    state["output_layer._extra_state"] = None
    assert [name for name, _ in state_dicts_to_hf([[state]], arch)] == hf_names(arch)
    # LayerNorm's fused bias: not a tensor of an RMSNorm model, so no rule may swallow it silently
    bad = dict(state, **{"decoder.layers.1.self_attention.linear_qkv.layer_norm_bias": torch.zeros(arch.hidden_size)})
    with pytest.raises(UnknownTensorError, match=r"layers\.1\.self_attention\.linear_qkv\.layer_norm_bias"):
        list(state_dicts_to_hf([[bad]], arch))
    # one norm in both spellings: which one is the weight cannot be told
    both = dict(state, **{"decoder.layers.0.input_layernorm.weight": torch.ones(arch.hidden_size)})
    with pytest.raises(ValueError, match=r"linear_qkv\.layer_norm_weight' and 'decoder\.layers\.0\.input_layernorm"):
        list(state_dicts_to_hf([[both]], arch))


def test_extra_states_are_written_only_under_the_models_keys(local_models):
    """The model's own keys decide which ``_extra_state`` entries are written, and megatron's strict load takes them.
    Megatron's own linears would also load without theirs (a load pre-hook defaults them, tensor_parallel/layers.py
    "Hook adding a default empty _extra_state"); TE's modules have no such hook: the GPU test shows they need them."""
    arch, hf_dir, model = local_models["qwen2"]
    hf = open_safetensors_dir(hf_dir)
    keys = list(model.state_dict())
    assert any(is_extra_state(k) for k in keys)
    state = hf_to_state_dict(hf, arch, keys)
    assert list(state) == keys and all(state[k].numel() == 0 for k in keys if is_extra_state(k))
    weights_only = [k for k in keys if not is_extra_state(k)]
    assert list(hf_to_state_dict(hf, arch, weights_only)) == weights_only
    before = {k: v.clone() for k, v in model.state_dict().items() if v is not None}
    model.load_state_dict(state)  # strict, as megatron loads
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    model.load_state_dict({k: state[k] for k in weights_only})  # megatron's linears default their extra state


@pytest.mark.gpu
@pytest.mark.te
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Transformer Engine's modules run on GPUs only")
def test_te_layout_equals_the_real_te_model(hf_models, moe_models):
    """On a GPU with TE: the real TE-spec model's state dict is ``te_layout`` of the local one, it loads the state dict
    built for its keys strictly, and both its state dict and the live export give back the HF tensors bit for bit."""
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel, te_status

    usable, why = te_status()
    if not usable:
        pytest.skip(f"needs Transformer Engine: {why}")
    dirs = {"hf_models": hf_models, "moe_models": moe_models}
    init_parallel(1, 1)
    try:
        for case, (group, name) in CASES.items():
            hf_dir = dirs[group][name]
            arch, hf = load_arch(hf_dir), open_safetensors_dir(hf_dir)
            te = _build(arch, use_te=True)
            state = te.state_dict()
            assert describe(state) == te_layout(_build(arch, use_te=False).state_dict(), arch), case
            built = hf_to_state_dict(hf, arch, state)
            # TE's modules (unlike megatron's linears) need their extra state in a strict load: megatron's load path
            with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: .*_extra_state"):
                te.load_state_dict({k: v for k, v in built.items() if not is_extra_state(k)})
            te.load_state_dict(built)
            exported = {n: t.cpu() for n, t in state_dicts_to_hf([[te.state_dict()]], arch)}
            streamed = {n: t.cpu() for bucket in stream_hf_buckets(te, arch) for n, t in bucket}
            assert list(exported) == list(streamed) == hf_names(arch), case
            for key in hf_names(arch):
                assert torch.equal(exported[key], hf[key]) and torch.equal(streamed[key], hf[key]), f"{case}: {key}"
    finally:
        destroy_parallel()
