"""Shared-prompt layout (train._shared_prompt): the tree mask, a hand-worked row, and micro-batches whose loss positions
are exactly the padded layout's, each once. (The gradient equals the padded one at TP2/PP2/DP2: tests/train/test_e2e.py;
a branch's logits equal its unpacked sequence's: tests/model/test_rope_positions.py.)"""

from __future__ import annotations

import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import build_microbatches
from megatron_offgrpo.train._packing import block_causal_mask, tree_mask
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches, group_segments


def test_tree_mask():
    # one segment: a prefix of 2, branches of 2 and 1; then a whole sequence of 2; one pad position
    sees = (~tree_mask([(2, (2, 1)), (2, ())], 8)[0, 0]).int().tolist()  # True = masked
    assert sees == [[1, 0, 0, 0, 0, 0, 0, 0],   # prefix
                    [1, 1, 0, 0, 0, 0, 0, 0],   # prefix
                    [1, 1, 1, 0, 0, 0, 0, 0],   # branch 0: the prefix and itself
                    [1, 1, 1, 1, 0, 0, 0, 0],   # branch 0
                    [1, 1, 0, 0, 1, 0, 0, 0],   # branch 1: the prefix, not branch 0
                    [0, 0, 0, 0, 0, 1, 0, 0],   # the whole sequence, on its own
                    [0, 0, 0, 0, 0, 1, 1, 0],
                    [0, 0, 0, 0, 0, 0, 0, 1]]   # the pad position sees itself only


def test_block_causal_mask_is_the_tree_mask_of_whole_sequences():
    assert torch.equal(block_causal_mask([3, 1, 4], 10), tree_mask([(3, ()), (1, ()), (4, ())], 10))


def _group(prompt: list[int], responses: list[list[int]], group_id: int) -> list[Sample]:
    return [Sample(prompt_id=f"p{group_id}", group_id=group_id, prompt_ids=list(prompt), response_ids=r,
                   behavior_logprobs=[-0.1 * (t + 1) for t in range(len(r))], policy_version=0, finish_reason="stop",
                   reward=float(i % 2)) for i, r in enumerate(responses)]


def test_a_hand_worked_row():
    # prompt 11 12 13 (P = 3), responses [21 22] and [31 32 33]: prefix "11 12", branch 0 "13 21", branch 1 "13 31 32"
    samples = _group([11, 12, 13], [[21, 22], [31, 32, 33]], 0)
    adv, valid = torch.tensor([0.5, -0.5]), torch.tensor([True, True])
    (mb,) = build_shared_prompt_microbatches(samples, adv, valid, 2, token_budget=100)
    # row length: the longest whole sequence, 3 + 3 - 1 = 5 positions; the segment is 2 + 2 + 3 = 7
    assert mb.tokens.tolist() == [[11, 12, 13, 21, 13, 31, 32]]
    assert mb.targets.tolist() == [[12, 13, 21, 22, 31, 32, 33]]
    assert mb.positions.tolist() == [[0, 1, 2, 3, 2, 3, 4]]  # each branch continues at P - 1
    assert mb.loss_mask.tolist() == [[False, False, True, True, True, True, True]]
    assert mb.advantages[mb.loss_mask].tolist() == [0.5, 0.5, -0.5, -0.5, -0.5]
    assert mb.behavior_logp[mb.loss_mask].tolist() == torch.tensor([-0.1, -0.2, -0.1, -0.2, -0.3]).tolist()
    assert mb.seq_ids.tolist() == [[0, 0, 1, 1, 2, 2, 2]]  # prefix, branch 0, branch 1
    assert torch.equal(mb.attention_mask, tree_mask([(2, (2, 3))], 7))


def test_a_group_whose_prompts_differ_falls_back_to_whole_sequences():
    samples = _group([1, 2], [[5], [6, 7]], 0)
    samples[1].prompt_ids = [1, 3]
    segments = group_segments(samples, 10)
    assert [seg.tree for seg in segments] == [(2, ()), (3, ())] and segments[1].pieces == ((11, 0, None),)
    assert [seg.tree for seg in group_segments(_group([1, 2], [[5], [6, 7]], 0), 0)] == [(1, (1, 2))]


def _step() -> list[Sample]:
    out = _group([1, 2, 3, 4, 5], [[40 + t for t in range(n)] for n in (2, 7, 3, 1)], 0)
    out += _group([6, 7], [[50 + t for t in range(n)] for n in (9, 4, 4, 2)], 1)
    out += _group([8, 9, 10], [[60 + t for t in range(n)] for n in (3, 3, 5, 6)], 2)
    mixed = _group([11, 12], [[70 + t for t in range(n)] for n in (2, 2, 8, 1)], 3)
    mixed[2].prompt_ids = [13, 14, 15]  # this group falls back to whole sequences
    return out + mixed


def _loss_tokens(mbs) -> list[tuple]:
    """(token predicted, its context's last token, advantage, behavior) of every loss position."""
    return sorted((int(t), int(x), float(a), float(b)) for mb in mbs for t, x, a, b, m in
                  zip(mb.flat("targets"), mb.flat("tokens"), mb.flat("advantages"), mb.flat("behavior_logp"),
                      mb.flat("loss_mask")) if m)


def test_every_response_token_lands_once_as_in_the_padded_layout():
    samples = _step()
    adv = torch.linspace(-1, 1, len(samples))
    valid = torch.ones(len(samples), dtype=torch.bool)
    valid[5] = False  # an invalid sample: its branch is written but leaves the loss
    (padded,) = build_microbatches(samples, adv, valid, 4, token_budget=10**6)
    for dp_size in (1, 2):
        ranks = [build_shared_prompt_microbatches(samples, adv, valid, 4, rank, dp_size, token_budget=40)
                 for rank in range(dp_size)]
        assert all(len({mb.tokens.shape for mb in mbs}) == 1 for mbs in ranks)  # one shape per rank (pipeline p2p)
        shared = [mb for mbs in ranks for mb in mbs]
        assert _loss_tokens(shared) == _loss_tokens([padded])
        # each loss position's sequence id holds exactly one sample's response (the per-sequence means)
        per_seq = sorted(int((mb.loss_mask & (mb.seq_ids == k)).sum()) for mb in shared
                         for k in mb.seq_ids[mb.loss_mask].unique().tolist())
        assert per_seq == sorted(len(s.response_ids) for s, ok in zip(samples, valid.tolist()) if ok)
    # positions written: groups 0-2 once per prompt, group 3 whole; fewer than the packed layout's
    used = sum(int((mb.tokens != 0).sum()) for mb in build_shared_prompt_microbatches(samples, adv, valid, 4,
                                                                                       token_budget=10**6))
    whole = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    assert used == whole - 3 * (5 - 1) - 3 * (2 - 1) - 3 * (3 - 1)  # (G - 1)(P - 1) saved per shared group


def test_positions_are_those_of_the_unpacked_sequence():
    samples = _step()
    adv, valid = torch.zeros(len(samples)), torch.ones(len(samples), dtype=torch.bool)
    for mb in build_shared_prompt_microbatches(samples, adv, valid, 4, token_budget=10**6):
        for k in mb.seq_ids.unique().tolist():
            spot = (mb.seq_ids == k) & (mb.tokens != 0)
            if not spot.any():
                continue  # the pad tail
            pos = mb.positions[spot].tolist()
            assert pos == list(range(pos[0], pos[0] + len(pos)))  # consecutive, from 0 (prefix) or P - 1 (branch)
