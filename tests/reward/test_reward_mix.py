"""How rule rewards and model scores make a group's rewards: clip, per-group standardisation, weights."""

from __future__ import annotations

import math

import pytest

from megatron_offgrpo.reward import RewardMix


def test_weights_clip_and_group_standardisation():
    assert RewardMix().rewards([1, 0], [0.5, -2.0]) == [1.5, -2.0]
    assert RewardMix(rule_weight=0.0, model_weight=2.0, clip=1.0).rewards([1, 0], [0.5, -2.0]) == [1.0, -2.0]
    mix = RewardMix(rule_weight=1.0, model_weight=0.5, normalize="group")
    scores = [3.0, 1.0, 2.0, 2.0]  # mean 2, population std sqrt(0.5)
    z = [(s - 2.0) / math.sqrt(0.5) for s in scores]
    assert mix.rewards([1, 0, 0, 1], scores) == pytest.approx([r + 0.5 * v for r, v in zip([1, 0, 0, 1], z)])
    assert mix.shaped([5.0, 5.0, 5.0]) == [0.0, 0.0, 0.0]  # equal scores: no signal, not a division by zero
    clipped = RewardMix(clip=1.0, normalize="group").shaped([10.0, 2.0, -3.0, 0.0])  # clip first, then standardise
    assert clipped == pytest.approx(RewardMix(normalize="group").shaped([1.0, 1.0, -1.0, 0.0]))
    with pytest.raises(ValueError):
        RewardMix().rewards([1.0], [1.0, 2.0])
