"""Rows for sequence parallelism: every layout pads its rows to a multiple of tp (``seq_multiple``) with pad
positions outside the loss, so the same tokens and loss positions are trained; the schedule refuses rows that
sequence parallelism cannot split. (The step itself at TP2 with SP: tests/train/test_sequence_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import build_microbatches, round_up
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches
from megatron_offgrpo.train._step import run_schedule

LAYOUTS = {"padded": build_microbatches, "packed": build_packed_microbatches,
           "shared": build_shared_prompt_microbatches}


def _samples() -> list[Sample]:
    # 2 groups of G=2 sharing their prompts; rows of 5 positions (the longest sample: 3 + 3 tokens), 7 with shared
    # prompts (the first group's prompt less one, then its responses: 2 + 3 + 2); both odd
    lengths = [(3, 3), (3, 2), (2, 2), (2, 1)]
    return [Sample(prompt_id=f"p{i // 2}", group_id=i // 2, prompt_ids=[5 + i // 2] * p, response_ids=[9 + i] * r,
                   behavior_logprobs=[-0.5] * r, policy_version=0, finish_reason="stop", reward=float(i % 2))
            for i, (p, r) in enumerate(lengths)]


def _trained(mbs) -> list[tuple]:
    """(token, target, position, advantage) of every loss position, sorted: what the step trains on (a longer row
    may pack sequences differently)."""
    out = []
    for mb in mbs:
        rows = mb.flat("loss_mask").nonzero().squeeze(1)
        out += zip(*(mb.flat(k)[rows].tolist() for k in ("tokens", "targets", "positions", "advantages")))
    return sorted(out)


def test_round_up():
    assert [round_up(n, 2) for n in (1, 2, 5, 6)] == [2, 2, 6, 6]
    assert round_up(7, 1) == 7 and round_up(7, 4) == 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_are_padded_to_the_multiple_and_pads_stay_out_of_the_loss(layout):
    build = LAYOUTS[layout]
    adv, valid = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), torch.ones(4, dtype=torch.bool)
    plain = build(_samples(), adv, valid, 2, token_budget=12)
    split = build(_samples(), adv, valid, 2, token_budget=12, seq_multiple=2)
    s = 7 if layout == "shared" else 5
    assert {mb.tokens.shape[1] for mb in plain} == {s} and {mb.tokens.shape[1] for mb in split} == {s + 1}
    # the same trained positions, tokens and advantages (packed rows of 6 may hold sequences differently)
    assert _trained(split) == _trained(plain)
    if layout == "padded":  # the added last position of every row is a pad
        assert not any(mb.loss_mask[:, -1].any() for mb in split)


def test_the_schedule_refuses_rows_sequence_parallelism_cannot_split():
    (mb,) = build_microbatches(_samples(), torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match=r"rows of 5 positions under sequence parallelism over 2 TP ranks: rows must "
                                         r"be a multiple of 2 \(build them with seq_multiple=2\)"):
        run_schedule(None, [mb], lambda m, h: None, forward_only=True, device=torch.device("cpu"), shard=(0, 2))
