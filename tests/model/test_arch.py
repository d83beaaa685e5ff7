"""Reading HF Qwen configs: every representable feature is carried, every unrepresentable field is named."""

from __future__ import annotations

import json

import pytest

from megatron_offgrpo.model import UnsupportedConfigError, arch_from_hf_config, hf_config_dict, load_arch
from tests.helpers import REPO, tiny_hf_config


def test_real_qwen25_05b_config():
    arch = load_arch(REPO / "megatron_offgrpo" / "assets" / "qwen2.5-0.5b-config")
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (24, 896, 14, 2, 64)
    assert arch.qkv_bias and not arch.qk_norm and arch.tie_word_embeddings and arch.rope_theta == 1e6
    assert arch.num_params() == 494_032_768  # Qwen2.5-0.5B's published parameter count (tied)


def test_qwen3_explicit_head_dim_and_qk_norm():
    arch = arch_from_hf_config(tiny_hf_config("qwen3"))
    assert arch.head_dim == 32 != arch.hidden_size // arch.num_heads
    assert arch.qk_norm and not arch.qkv_bias


def test_rope_parameters_of_transformers_v5_are_read():
    cfg = dict(tiny_hf_config("qwen2"), rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    cfg.pop("rope_theta")
    assert arch_from_hf_config(cfg).rope_theta == 5e5


@pytest.mark.parametrize(
    "override,named",
    [
        ({"model_type": "llama"}, "model_type='llama'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "yarn"),
        ({"num_experts": 8}, "num_experts"),
    ],
)
def test_unrepresentable_fields_are_named(override, named):
    with pytest.raises(UnsupportedConfigError, match=named.replace("(", r"\(")):
        arch_from_hf_config(dict(tiny_hf_config("qwen2"), **override))


def test_layout_errors_name_every_field_and_the_fix():
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    with pytest.raises(ValueError) as err:
        arch.check_layout(tp=8, pp=3)
    text = str(err.value)
    for fragment in ("num_attention_heads=4", "num_key_value_heads=2", "num_hidden_layers=4 is not divisible by pp=3"):
        assert fragment in text


def test_hf_config_round_trips(tmp_path):
    for model_type in ("qwen2", "qwen3"):
        arch = arch_from_hf_config(tiny_hf_config(model_type, tied=True))
        (tmp_path / "config.json").write_text(json.dumps(hf_config_dict(arch)))
        assert load_arch(tmp_path) == arch


def test_te_spec_refused_on_cpu_with_reason():
    from megatron_offgrpo.model._spec import qwen_layer_spec
    from megatron_offgrpo.runtime import have_te

    if have_te():
        pytest.skip("Transformer Engine is usable here; the refusal is for machines without it")
    with pytest.raises(RuntimeError, match="Transformer Engine"):
        qwen_layer_spec(qk_norm=False, use_te=True)
    assert qwen_layer_spec(qk_norm=True) is not None  # local spec fallback
