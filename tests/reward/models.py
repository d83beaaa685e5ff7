"""The reward tests' models: real HF directories (the tiny Qwen2 asset's shape, the bundled Qwen2.5 tokenizer) that
transformers and vLLM both load.

- ``classifier_dir``: a sequence classifier with one label and a large random init, so that scores differ by whole
  units between texts.
- ``verdict_judge_dir``: a causal LM whose weights are set so that its first reply token is a chosen verdict
  ("yes", "no", a digit) with a margin: every position's residual carries a constant in dimension 0 (the embeddings
  put it there, no layer writes it), the final norm keeps only that dimension, and the LM head reads it into the
  verdict tokens alone. Its log-probs still vary with the input (the norm divides by the whole residual's size), so
  a soft score is a real forward's, not a constant.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers import REPO, TOKENIZER_DIR, with_tokenizer

ASSET = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"
TOKENIZER = TOKENIZER_DIR


def _config(**changes) -> transformers.PretrainedConfig:
    config = transformers.AutoConfig.from_pretrained(ASSET)
    for key, value in changes.items():
        setattr(config, key, value)
    return config


def classifier_dir(directory: Path, seed: int = 0) -> Path:
    """A one-label ``Qwen2ForSequenceClassification`` (pad = ``<|endoftext|>``, as Qwen's tokenizer)."""
    config = _config(num_labels=1, architectures=["Qwen2ForSequenceClassification"], pad_token_id=151643,
                     initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(directory)
    return with_tokenizer(directory)


def verdict_judge_dir(directory: Path, logits: dict[str, float], seed: int = 0) -> Path:
    """A judge that replies with the token of ``logits``' largest value first: each word (one token of the bundled
    tokenizer, e.g. "yes", " no", "7") gets that weight in the LM head; every other token reads 0."""
    config = _config(initializer_range=0.2)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 4.0
        for layer in model.model.layers:  # nothing writes dimension 0 of the residual: it stays 4 everywhere
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        for word, value in logits.items():
            (token,) = tokenizer.encode(word, add_special_tokens=False)
            model.lm_head.weight[token, 0] = value
    model.save_pretrained(directory)
    return with_tokenizer(directory)
