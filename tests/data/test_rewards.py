"""Answer extraction and rewards: GSM8K's `#### 1,000`, negatives, decimals, $, \\boxed{}, and the fallbacks."""

from __future__ import annotations

import pytest

from megatron_offgrpo.data._datasets import load_records
from megatron_offgrpo.data._rewards import extract_answer, get_reward, math_exact_reward, math_strict_reward


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so she sold 72 clips.\n#### 72", "72"),
        ("#### 1,000", "1000"),
        ("#### -5", "-5"),
        ("The total is $1,234.50 so #### $1,234.50", "1234.5"),
        ("#### 3.0", "3"),
        ("#### .5", "0.5"),
        ("first \\boxed{12} then \\boxed{\\frac{1}{2}} no wait \\boxed{-7}", "-7"),
        ("nested \\boxed{\\text{ans} 1{,}000}", "1000"),  # LaTeX thousands separator
        ("The answer is 42.", "42"),
        ("I think 3 apples and 4 pears, 7 in all", "7"),
        ("no digits here", None),
        ("#### 10\n\\boxed{11}", "11"),  # \boxed{} has precedence over ####
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_every_gsm8k_ground_truth_parses_to_its_hash_number():
    for split in ("train", "test"):
        records = load_records("gsm8k", split)
        assert len(records) == {"train": 7473, "test": 1319}[split]
        for record in records:
            raw = record.answer.rsplit("####", 1)[1].strip()
            assert extract_answer(record.answer) == raw.replace(",", "").lstrip("+"), record.record_id


def test_math_rewards():
    truth = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert math_exact_reward("48 + 24 = 72\n#### 72", truth) == 1.0
    assert math_exact_reward("It is 72.", truth) == 1.0  # last-number fallback
    assert math_strict_reward("It is 72.", truth) == 0.0  # strict needs #### or \boxed{}
    assert math_strict_reward("\\boxed{72}", truth) == 1.0
    assert math_exact_reward("#### 71", truth) == 0.0
    assert math_exact_reward("#### 1,000", "#### 1000") == 1.0
    with pytest.raises(ValueError, match="needs the ground-truth"):
        math_exact_reward("1", None)


def test_reward_registry_lists_valid_names():
    assert get_reward("math_exact") is math_exact_reward
    with pytest.raises(ValueError, match=r"valid: \['math_exact', 'math_strict'"):
        get_reward("nope")
    assert get_reward("megatron_offgrpo.data._rewards:math_exact_reward") is math_exact_reward
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("megatron_offgrpo.data._rewards:missing")


def test_integers_longer_than_decimal_precision_are_scored_not_raised():
    # a sampled completion may hold any digit string; Decimal's 28-digit context made quantize() raise
    long = "1" * 40
    assert extract_answer(f"#### {long}") == long
    assert extract_answer(f"#### {long}.000") == long
    assert math_exact_reward(f"#### {long}", "#### 2") == 0.0
    assert math_exact_reward(f"#### {long}", f"#### {long}") == 1.0
