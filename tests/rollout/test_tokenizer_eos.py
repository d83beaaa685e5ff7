"""``rollout._vllm_engine.tokenizer_eos_id``: the in-process engine's end-of-sequence id, read from the tokenizer's
files (vLLM then loads no tokenizer), is the id transformers gives, for every layout of tokenizer files the
project meets; None where the files do not name one."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from megatron_offgrpo.data import ASSETS
from megatron_offgrpo.rollout._vllm_engine import tokenizer_eos_id
from tests.helpers import qwen3_tokenizer_dir


def _bundled(directory):
    shutil.copytree(ASSETS / "qwen2-tokenizer", directory)
    return directory


def _fast_only(directory):  # tokenizer.json + tokenizer_config.json, as save_pretrained writes them
    AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer").save_pretrained(directory)
    for name in ("vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    return directory


def _eos_changed(directory):  # a tokenizer whose eos is another added token
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer")
    tokenizer.eos_token = "<|endoftext|>"
    tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("make", [_bundled, qwen3_tokenizer_dir, _fast_only, _eos_changed],
                         ids=["qwen2.5", "qwen3", "tokenizer.json", "eos-changed"])
def test_the_eos_id_read_from_the_files_is_transformers_own(make, tmp_path):
    directory = make(tmp_path / "tok")
    assert tokenizer_eos_id(directory) == AutoTokenizer.from_pretrained(directory).eos_token_id


def test_no_tokenizer_files_no_id(tmp_path):
    shutil.copytree(ASSETS / "tiny-qwen2", tmp_path / "model")
    assert tokenizer_eos_id(tmp_path / "model") is None
    (tmp_path / "model" / "tokenizer_config.json").write_text("{not json")
    assert tokenizer_eos_id(tmp_path / "model") is None
