"""The per-rank checkpoint directories of earlier versions export to HF: HF -> that format at TP x PP -> HF is
bit-exact for every layout, tied and untied, Qwen2 and Qwen3 (the weight map's TP split against the reader's merge),
so any two layouts of a model export to the same tensors; the exported directory loads with transformers (model and
tokenizer) and computes the same logits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from checkpoint_tools import open_safetensors_dir
from checkpoint_tools._convert import megatron_to_hf_dir
from tests.checkpoint.legacy_format import write_legacy_checkpoint
from tests.helpers import TOKENIZER_DIR

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]


def assert_same_hf_tensors(a_dir, b_dir, drop_lm_head: bool) -> None:
    a, b = open_safetensors_dir(a_dir), open_safetensors_dir(b_dir)
    a_names = set(a.names()) - ({"lm_head.weight"} if drop_lm_head else set())
    assert a_names == set(b.names())
    for name in a_names:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), f"{name} changed in the round trip"


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_legacy_checkpoint_exports_bit_exactly_at_every_layout(hf_models, tmp_path, tp, pp):
    for name, hf_dir in hf_models.items():
        mega = write_legacy_checkpoint(hf_dir, tmp_path / f"{name}.mega", tp, pp)
        assert len(list(mega.glob("mp_rank_*/model.safetensors"))) == tp * pp  # so the reader really merges shards
        back = megatron_to_hf_dir(mega, tmp_path / f"{name}.hf", max_shard_bytes=40_000)
        assert_same_hf_tensors(hf_dir, back, drop_lm_head="_tied" in name)
        config = json.loads((back / "config.json").read_text())
        original = json.loads((hf_dir / "config.json").read_text())
        for key in ("model_type", "hidden_size", "num_key_value_heads", "tie_word_embeddings", "rms_norm_eps"):
            assert config[key] == original[key], key


def test_legacy_export_loads_with_transformers_and_matches_logits(hf_models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(hf_models["qwen2_untied"], src)
    for f in TOKENIZER_DIR.iterdir():
        if f.suffix in (".json", ".txt"):
            shutil.copy(f, src / f.name)
    mega = write_legacy_checkpoint(src, tmp_path / "mega", tp=2, pp=2)
    out = megatron_to_hf_dir(mega, tmp_path / "out", max_shard_bytes=60_000)
    assert (out / "model.safetensors.index.json").exists() and (out / "generation_config.json").exists()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok("12 + 30 = 42")["input_ids"]) == "12 + 30 = 42"
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)
