"""DAPO's soft overlong punishment by hand."""

import pytest

from megatron_offgrpo.algo import overlong_penalty


@pytest.mark.parametrize("length, expected", [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (20, -1.0)])
def test_overlong_penalty_by_hand(length, expected):
    # max 16 tokens, buffer 4: free up to 12 tokens, then -1/4 per token to -1 at 16 (never below)
    assert overlong_penalty(length, 16, 4) == pytest.approx(expected)


def test_overlong_penalty_scale_and_off():
    assert overlong_penalty(16, 16, 4, penalty=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(16, 16, 0) == 0.0  # buffer 0: no shaping
    assert overlong_penalty(3, 16, 16) == pytest.approx(-3 / 16)  # buffer = the whole length
