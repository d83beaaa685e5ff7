"""The warm-up's teacher: the ground truth in the reward's format, or (sft.off_by_one_fraction) the ground truth + 1."""

from __future__ import annotations

import random

import pytest
import transformers

from megatron_offgrpo.config import load_config
from megatron_offgrpo.data import Prompt, build_prompt, records, rewards
from megatron_offgrpo.train._sft import teacher_batch
from tests.helpers import TOKENIZER_DIR


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _answers(samples, tokenizer) -> list[int]:
    for s in samples:
        assert s.response_ids[-1] == tokenizer.eos_token_id and s.prompt_ids
    return [int(rewards.extract_answer(tokenizer.decode(s.response_ids, skip_special_tokens=True))) for s in samples]


@pytest.mark.parametrize("fraction", [0.0, 0.6, 1.0])
def test_the_teacher_is_wrong_by_one_in_the_given_fraction(tokenizer, fraction):
    prompts = [build_prompt(r, tokenizer, instruction="", prompt_format="plain")
               for r in records.arithmetic_records(2000, 3)]
    samples = teacher_batch(prompts, tokenizer, random.Random(0), fraction)
    truths = [int(rewards.extract_answer(p.answer)) for p in prompts]
    answers = _answers(samples, tokenizer)
    assert all(a - t in (0, 1) for a, t in zip(answers, truths))
    wrong = sum(a != t for a, t in zip(answers, truths)) / len(prompts)
    assert abs(wrong - fraction) < 0.03, wrong  # 2000 draws: the binomial's std is 0.011


def test_a_non_integer_answer_cannot_be_shifted(tokenizer):
    prompt = Prompt("q/7", (1, 2), "Half of 3?", "#### 1.5")
    samples = teacher_batch([prompt], tokenizer, random.Random(0), 0.0)  # the ground truth itself is fine
    assert tokenizer.decode(samples[0].response_ids, skip_special_tokens=True) == "#### 1.5"
    with pytest.raises(ValueError, match="prompt q/7: sft.off_by_one_fraction needs integer answers, got '1.5'"):
        teacher_batch([prompt], tokenizer, random.Random(0), 1.0)


@pytest.mark.parametrize("override, message", [
    ("sft.off_by_one_fraction=1.5", "sft.off_by_one_fraction=1.5: must be in [0, 1]"),
    ("data.prompt_format=raw", "data.prompt_format='raw': expected one of ['chat', 'plain']"),
])
def test_bad_warm_up_keys_are_refused_at_load(override, message):
    with pytest.raises(ValueError) as err:
        load_config(None, [override])
    assert message in str(err.value)
