"""Datasets load offline, prompts use the real Qwen chat template, and the prompt stream resumes exactly."""

from __future__ import annotations

import json

import pytest
import transformers

from megatron_offgrpo.data import PromptStream, build_prompt
from megatron_offgrpo.data._datasets import arithmetic_records, load_records
from megatron_offgrpo.data._datasets import load_local
from tests.helpers import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_gsm8k_prompt_uses_chat_template(tokenizer):
    record = load_records("gsm8k", "test")[0]
    assert record.record_id == "gsm8k/test/0"
    prompt = build_prompt(record, tokenizer)
    text = tokenizer.decode(prompt.prompt_ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert record.question in text and prompt.answer == record.answer


def test_plain_prompt_is_the_text_without_special_tokens(tokenizer):
    record = arithmetic_records(1, seed=0)[0]
    prompt = build_prompt(record, tokenizer, instruction="", prompt_format="plain")
    assert tokenizer.decode(prompt.prompt_ids) == record.question  # "What is a + b?": no template, no special token
    with_system = build_prompt(record, tokenizer, system_prompt="Add.", instruction="Answer.", prompt_format="plain")
    assert tokenizer.decode(with_system.prompt_ids) == f"Add.\n{record.question}\nAnswer."
    with pytest.raises(ValueError, match="expected one of \\['chat', 'plain'\\]"):
        build_prompt(record, tokenizer, prompt_format="raw")


def test_prompt_length_limit_is_enforced(tokenizer):
    record = load_records("gsm8k", "train")[0]
    with pytest.raises(ValueError, match="max_prompt_tokens=10"):
        build_prompt(record, tokenizer, max_prompt_tokens=10)


def test_local_jsonl_with_custom_keys_and_bad_rows(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": "#### 2"}) + "\n")
    assert load_local(path, question_key="q", answer_key="a")[0].answer == "#### 2"
    with pytest.raises(ValueError, match="d.jsonl:1: no 'question' key \\(the row has \\['a', 'q'\\]\\)"):
        load_local(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="d.jsonl:1: not valid JSON"):
        load_local(path)
    with pytest.raises(ValueError, match="data.source='web'"):
        load_records("gsm8k", source="web")


def test_arithmetic_task_is_deterministic_and_verifiable():
    a, b = arithmetic_records(5, seed=3), arithmetic_records(5, seed=3)
    assert a == b
    q = a[0].question.removeprefix("What is ").removesuffix("?").split(" + ")
    assert a[0].answer == f"#### {int(q[0]) + int(q[1])}"
    assert load_records("arithmetic", "test", count=3)[0] != load_records("arithmetic", "train", count=3)[0]


def test_prompt_stream_epochs_and_exact_resume(tokenizer):
    prompts = [build_prompt(r, tokenizer) for r in arithmetic_records(7, seed=0)]
    stream = PromptStream(prompts, seed=5)
    first_epoch = stream.next_batch(7)
    assert sorted(p.prompt_id for p in first_epoch) == sorted(p.prompt_id for p in prompts)
    stream.next_batch(3)
    state = stream.state_dict()
    expected = stream.next_batch(6)  # crosses into epoch 2
    resumed = PromptStream(prompts, seed=5)
    resumed.load_state_dict(state)
    assert resumed.next_batch(6) == expected
    with pytest.raises(ValueError, match="resume with the same data and seed"):
        PromptStream(prompts[:3], seed=5).load_state_dict(state)
