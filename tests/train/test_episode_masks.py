"""A multi-turn episode trains the model's own tokens only: every layout (padded, packed, shared prompt) puts the
environment's tokens outside the loss, and the token-mean normaliser counts the model's tokens."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import build_microbatches, global_token_count
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches

# prompt 3 tokens; response: turn 1 (3 tokens), observation (2), turn 2 (2)
TRAINABLE = [True, True, True, False, False, True, True]


def _episodes() -> list[Sample]:
    out = []
    for i in range(4):
        response = list(range(200 + 10 * i, 207 + 10 * i))
        logps = [-0.1 * (j + 1) if t else 0.0 for j, t in enumerate(TRAINABLE)]
        out.append(Sample(f"p{i // 2}", i // 2, [1, 2, 3 + i // 2], response, logps, 0, "stop", reward=float(i % 2),
                          trainable=list(TRAINABLE), turns=2))
    return out


def _trained_targets(mbs) -> list[list[int]]:
    """Per row, the target ids where the loss mask is True, in position order."""
    rows = []
    for mb in mbs:
        for b in range(mb.tokens.shape[0]):
            picked = mb.targets[b][mb.loss_mask[b]].tolist()
            if picked:
                rows.append(picked)
    return rows


@pytest.mark.parametrize("layout", ["padded", "packed", "shared_prompt"])
def test_only_the_models_tokens_enter_the_loss(layout):
    samples = _episodes()
    adv, valid = torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=torch.bool)
    build = {"padded": build_microbatches, "packed": build_packed_microbatches,
             "shared_prompt": build_shared_prompt_microbatches}[layout]
    mbs = build(samples, adv, valid, 2, token_budget=64)
    model_tokens = sorted(t for s in samples for t, keep in zip(s.response_ids, s.trainable) if keep)
    assert sorted(t for row in _trained_targets(mbs) for t in row) == model_tokens
    for mb in mbs:  # the behavior log-probs under the mask are the model tokens' own (never an observation's 0)
        assert (mb.behavior_logp[mb.loss_mask] < 0).all()
    assert global_token_count(samples, valid) == 5 * 4


def test_an_invalid_episode_trains_nothing():
    samples = _episodes()
    valid = torch.tensor([True, False, True, True])
    (mb,) = build_microbatches(samples, torch.ones(4), valid, 2, token_budget=64)
    assert int(mb.loss_mask[1].sum()) == 0 and int(mb.loss_mask[0].sum()) == 5
    assert global_token_count(samples, valid) == 15


def test_trainable_flags_match_the_response():
    with pytest.raises(ValueError, match="trainable flags"):
        Sample("p", 0, [1], [2, 3], [-1.0, -1.0], 0, "stop", trainable=[True])
