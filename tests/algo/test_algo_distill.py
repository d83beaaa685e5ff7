"""On-policy distillation's advantages, worked by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.algo import distill_advantages, reverse_kl_sums


def test_per_token_advantage_is_teacher_minus_student_on_trained_tokens():
    teacher = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    student = torch.tensor([-1.5, -1.0, -0.5, -0.1])
    mask = torch.tensor([True, True, False, True])
    assert torch.equal(distill_advantages(teacher, student, mask), torch.tensor([0.5, -1.0, 0.0, -2.9]))


def test_discounted_sums_stay_inside_a_sequence_and_skip_untrained_tokens():
    # d = [1, 2, (masked 5), 4 | 8, 16]; gamma = 0.5:
    # seq 0: A_3 = 4, A_1 = 2 + 0.5 * 4 = 4, A_0 = 1 + 0.5 * 4 = 3 (the masked token neither counts nor waits)
    # seq 1: A_5 = 16, A_4 = 8 + 0.5 * 16 = 16
    teacher = torch.tensor([1.0, 2.0, 5.0, 4.0, 8.0, 16.0])
    student = torch.zeros(6)
    mask = torch.tensor([True, True, False, True, True, True])
    seq = torch.tensor([0, 0, 0, 0, 1, 1])
    got = distill_advantages(teacher, student, mask, seq, discount=0.5)
    assert got.tolist() == [3.0, 4.0, 0.0, 4.0, 16.0, 16.0]
    undiscounted = distill_advantages(teacher, student, mask, seq, discount=1.0)
    assert undiscounted.tolist() == [7.0, 6.0, 0.0, 4.0, 24.0, 16.0]


def test_reverse_kl_sums_and_bad_discount():
    teacher, student = torch.tensor([-1.0, -2.0, -4.0]), torch.tensor([-0.5, -2.5, -1.0])
    sums = reverse_kl_sums(teacher, student, torch.tensor([True, True, False]))
    assert sums.tolist() == [0.0, 2.0]  # (+0.5) + (-0.5) over 2 tokens
    with pytest.raises(ValueError, match="discount"):
        distill_advantages(teacher, student, torch.ones(3, dtype=torch.bool), discount=1.5)
