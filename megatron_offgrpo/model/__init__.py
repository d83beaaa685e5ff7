"""Model: HF Qwen config -> megatron ``TransformerConfig`` + layer spec -> one PP stage of a ``GPTModel``."""

from megatron_offgrpo.model._arch import (
    QwenArch,
    UnsupportedConfigError,
    arch_from_hf_config,
    hf_config_dict,
    load_arch,
    resolve_model_dir,
)
from megatron_offgrpo.model._compile import compile_layers
from megatron_offgrpo.model._tokenizer import load_tokenizer, tokenizer_errors

__all__ = [
    "QwenArch",
    "UnsupportedConfigError",
    "arch_from_hf_config",
    "build_gpt_stage",
    "compile_layers",
    "expose_hidden_states",
    "hf_config_dict",
    "load_arch",
    "load_tokenizer",
    "lora",
    "output_weight",
    "precision",
    "resolve_model_dir",
    "tokenizer_errors",
    "transformer_config",
]


def __getattr__(name: str):
    # The builder imports megatron.core (5-7 s, and TE detection must run first): load it only when used.
    if name in ("build_gpt_stage", "transformer_config", "expose_hidden_states", "output_weight"):
        from megatron_offgrpo.model import _builder

        return getattr(_builder, name)
    if name == "precision":  # precision.params_dtype, precision.precision_transformer_config
        from megatron_offgrpo.model import _precision

        return _precision
    if name == "lora":  # lora.LoraSpec, lora.lora_spec, lora.attach_lora, lora.adapter_parameters
        from megatron_offgrpo.model import _lora

        return _lora
    raise AttributeError(name)
