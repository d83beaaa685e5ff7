"""The unbiased pass@k estimator and the k a sampled evaluation reports."""

from __future__ import annotations

import math

import pytest

from megatron_offgrpo.sampler._eval import pass_at_k, pass_ks


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3, 2) / C(4, 2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k: certain
    assert pass_at_k(8, 8, 1) == 1.0


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_pass_at_k_equals_the_binomial_formula(n):
    for correct in range(n + 1):
        for k in range(1, n + 1):
            exact = 1 - math.comb(n - correct, k) / math.comb(n, k)
            assert pass_at_k(n, correct, k) == pytest.approx(exact, abs=1e-12)
        assert pass_at_k(n, correct, 1) == pytest.approx(correct / n)  # pass@1 is the fraction right


def test_pass_at_k_refuses_impossible_counts():
    for args in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*args)


def test_reported_ks():
    assert pass_ks(1) == [1] and pass_ks(2) == [1, 2] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]
