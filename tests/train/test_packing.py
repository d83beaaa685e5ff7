"""Packing plans (train._packing): groups balanced over DP ranks by tokens, first-fit-decreasing packs, the
block-diagonal causal mask, and packed micro-batches that hold exactly the padded ones' tokens and loss positions.
(The packed gradient equals the reference loss's over DP=2: tests/train/test_e2e.py.)"""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import build_microbatches
from megatron_offgrpo.train._packing import balance_groups, block_causal_mask, build_packed_microbatches, pack_lengths
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches


def test_groups_are_balanced_by_tokens():
    # 9, 7, 6, 5, 4 tokens over 2 ranks: 9 -> r0, 7 -> r1, 6 -> r1 (7 < 9), 5 -> r0 (9 < 13), 4 -> r1 (14 > 13)
    assert balance_groups([5, 9, 4, 7, 6], 2) == [[0, 1], [2, 3, 4]]
    assert balance_groups([3, 3, 3], 1) == [[0, 1, 2]]
    assert balance_groups([1], 3) == [[0], [], []]


def test_first_fit_decreasing_packs():
    # budget 10, longest first: 12 alone (over budget), 8 opens a pack, 6 and 5 each too (8 + 6, 6 + 5 > 10),
    # then 4 fills 6's pack and 2 fills 8's
    assert pack_lengths([2, 5, 8, 4, 6, 12], 10) == [[5], [2, 0], [4, 3], [1]]


def test_block_causal_mask():
    mask = block_causal_mask([2, 3], 6)[0, 0]  # True = masked
    sees = (~mask).int().tolist()
    assert sees == [[1, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0],
                    [0, 0, 1, 0, 0, 0],
                    [0, 0, 1, 1, 0, 0],
                    [0, 0, 1, 1, 1, 0],
                    [0, 0, 0, 0, 0, 1]]  # the pad position sees itself only


def _samples(lengths: list[tuple[int, int]]) -> list[Sample]:
    out = []
    for i, (prompt, response) in enumerate(lengths):
        out.append(Sample(prompt_id=f"p{i // 2}", group_id=i // 2, prompt_ids=list(range(1, prompt + 1)),
                          response_ids=list(range(100 + i, 100 + i + response)), behavior_logprobs=[-0.5] * response,
                          policy_version=0, finish_reason="stop", reward=float(i % 2)))
    return out


def test_packed_microbatches_hold_the_padded_tokens_without_padding_inside():
    # 3 groups of G = 2; 4, 5, 5, 8, 10, 4 positions
    samples = _samples([(3, 2), (3, 3), (5, 1), (5, 4), (2, 9), (2, 3)])
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.25, -0.25])
    valid = torch.tensor([True, True, True, True, False, False])
    packed = build_packed_microbatches(samples, adv, valid, 2, token_budget=20)
    (padded,) = build_microbatches(samples, adv, valid, 2, token_budget=10**6)
    # rows of the longest sequence (2 + 9 - 1 = 10 positions), 20 // 10 = 2 rows per micro-batch
    assert {mb.tokens.shape for mb in packed} == {(2, 10)}
    assert all(mb.attention_mask.shape == (2, 1, 10, 10) for mb in packed)
    used = sum(int((mb.tokens != 0).sum()) for mb in packed)  # token ids here are never 0, the pad id
    assert used == sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)  # every position, once
    assert sum(mb.tokens.numel() for mb in packed) == 40 < padded.tokens.numel() == 60  # rows 10 | 8 | 5+5 | 4+4
    # the loss sees the same (target, advantage, behavior) tokens, in another order
    def loss_tokens(mbs):
        return sorted((int(t), float(a), float(b)) for mb in mbs for t, a, b, m in
                      zip(mb.flat("targets"), mb.flat("advantages"), mb.flat("behavior_logp"), mb.flat("loss_mask"))
                      if m)
    assert loss_tokens(packed) == loss_tokens([padded])
    for mb in packed:  # positions restart at 0 per sequence
        for k in mb.seq_ids[mb.tokens != 0].unique().tolist():
            assert mb.positions[mb.seq_ids == k].tolist() == list(range(int((mb.seq_ids == k).sum())))


@pytest.mark.parametrize("groups", [3, 1])
@pytest.mark.parametrize("build", [build_microbatches, build_packed_microbatches, build_shared_prompt_microbatches],
                         ids=["padded", "packed", "shared-prompt"])
def test_groups_not_a_multiple_of_dp_are_dealt_unevenly_and_none_is_lost(build, groups):
    """3 groups over DP 2: 2 and 1; 1 group: 1 and none (the empty rank trains a pad row, outside the loss). Every
    loss token lands on exactly one rank (the gradient test: test_e2e's uneven case); the padded layout keeps one
    shape and count on every rank."""
    samples = _samples([(3, 2), (3, 3), (5, 1), (5, 4), (2, 9), (2, 3)][:2 * groups])
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0, 0.25, -0.25][:2 * groups])
    valid = torch.ones(2 * groups, dtype=torch.bool)
    whole = build(samples, adv, valid, 2, token_budget=100)
    ranks = [build(samples, adv, valid, 2, rank, 2, token_budget=100) for rank in (0, 1)]
    assert all(len(mbs) >= 1 for mbs in ranks)
    assert sorted(_loss_tokens(ranks[0]) + _loss_tokens(ranks[1])) == sorted(_loss_tokens(whole))
    assert [len(_loss_tokens(mbs)) > 0 for mbs in ranks] == [True, groups > 1]
    if build is build_microbatches:
        assert [[mb.tokens.shape for mb in mbs] for mbs in ranks][0] == [mb.tokens.shape for mb in ranks[1]]


def _loss_tokens(mbs):
    return [(int(t), float(a), float(b)) for mb in mbs for t, a, b, m in
            zip(mb.flat("targets"), mb.flat("advantages"), mb.flat("behavior_logp"), mb.flat("loss_mask")) if m]
