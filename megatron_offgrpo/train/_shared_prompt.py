"""Samples -> shared-prompt micro-batches: a group's prompt computed once for its G samples (issue 19, item 2).

Packed rows (``_packing``) still compute every sample's prompt, G times per group. Here a group whose samples share
their ``prompt_ids`` (a rollout's group always does) becomes one segment, "one prompt, G branches":

    prompt[:-1]                          the shared prefix, P - 1 positions, in no loss (it predicts prompt tokens)
    [prompt[-1]] + response_i[:-1]       branch i, R_i positions, for each sample i

The last prompt token is repeated at the head of every branch, so each position still has exactly one target
(branch i's copy predicts ``response_i[0]``) and ``MicroBatch``, the fused loss and its normalisers are unchanged.
Positions: the prefix 0..P-2, branch i P-1..P-2+R_i (the unpacked sequence's). The tree mask
(``_packing.tree_mask``): a prefix token sees the earlier prefix; a branch token sees the whole prefix and the earlier
tokens of its own branch. Each branch is its own sequence for per-sequence means (``seq_ids``); the prefix and the pad
tail get ids of their own and never enter the loss. A group whose prompts differ falls back to whole sequences.

Exactness: every branch token attends to exactly the keys it attends to in its unpacked sequence, with the same
values, and its rotary angles come from its position id (``model._rope``: megatron alone would use its place in the
row, shifted by the earlier branches), so the outputs, and the gradient, equal the padded layout's up to rounding.
The local spec only: TE's attention takes a dense mask only as ``arbitrary`` (unfused) and its THD path only
block-diagonal ``cu_seqlens``, which cannot say "the prefix, then my branch" (``optim.shared_prompt`` is refused
there; see ``preflight``).

Cost: the segment saves (G - 1)(P - 1) positions of G whole sequences. Rows are as long as the longest segment (or the
step's longest sequence, if longer), the same for every micro-batch (pipeline p2p); the mask is dense, so attention
per position costs a row's length, as in the packed layout.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import MicroBatch, StepRows, check_step, round_up
from megatron_offgrpo.train._packing import balance_groups, pack_lengths, tree_mask


@dataclasses.dataclass(frozen=True)
class Segment:
    """Positions a row holds back to back: a shared prompt with its branches, or one whole sequence.

    Attributes:
        pieces: ``(sample index, first, last)`` per piece in row order: positions ``first..last-1`` of that sample
            (``last`` None: to its end), as ``StepRows.put`` writes them.
        in_loss: per piece, whether its targets may enter the loss (False for the shared prefix).
        tree: ``(prefix positions, branch positions...)`` for ``tree_mask``.
    """

    pieces: tuple[tuple[int, int, int | None], ...]
    in_loss: tuple[bool, ...]
    tree: tuple[int, tuple[int, ...]]

    @property
    def length(self) -> int:
        return self.tree[0] + sum(self.tree[1])


def group_segments(samples: Sequence[Sample], first_index: int) -> list[Segment]:
    """The segments of one group (``samples``, the step's samples ``first_index..``): one shared-prompt segment when
    every sample has the same non-empty ``prompt_ids``, else one whole-sequence segment per sample."""
    prompt = list(samples[0].prompt_ids)
    indices = range(first_index, first_index + len(samples))
    if prompt and all(list(s.prompt_ids) == prompt for s in samples):
        p = len(prompt)
        pieces = ((first_index, 0, p - 1),) + tuple((i, p - 1, None) for i in indices)
        return [Segment(pieces, (False,) + (True,) * len(samples),
                        (p - 1, tuple(len(s.response_ids) for s in samples)))]
    return [Segment(((i, 0, None),), (True,), (len(s.prompt_ids) + len(s.response_ids) - 1, ()))
            for i, s in zip(indices, samples)]


def build_shared_prompt_microbatches(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    sample_valid: torch.Tensor,
    group_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    token_budget: int = 4096,
    device: torch.device | str = "cpu",
    seq_multiple: int = 1,
) -> list[MicroBatch]:
    """This rank's shared-prompt micro-batches of one step (arguments as ``build_microbatches``).

    Rows are ``L`` positions, the longest segment or the step's longest sequence (the same on every rank), and hold
    whole segments first-fit decreasing; ``token_budget // L`` rows make a micro-batch (at least one). Groups go to
    DP ranks balanced by positions; the loss normalisers stay the step's global counts, so the gradient is the padded
    layout's.
    """
    check_step(samples, advantages, group_size)
    groups = [group_segments(samples[g:g + group_size], g) for g in range(0, len(samples), group_size)]
    longest = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    s = round_up(max([longest] + [seg.length for group in groups for seg in group]), seq_multiple)
    balanced = balance_groups([sum(seg.length for seg in group) for group in groups], dp_size)[dp_rank]
    mine = [seg for g in balanced for seg in groups[g]]
    packs = [[mine[i] for i in pack] for pack in pack_lengths([seg.length for seg in mine], s)]
    packs = packs or [[]]  # a rank dealt no group (fewer groups than DP ranks): one pad row, in no loss
    per_micro = max(1, min(len(packs), token_budget // s))
    packs += [[]] * (-len(packs) % per_micro)  # empty rows: every micro-batch has the same shape (pipeline p2p)
    rows = StepRows.zeros(len(packs), s, samples)
    seq_ids = torch.zeros(len(packs), s, dtype=torch.long)
    next_id = 0
    for row, pack in enumerate(packs):
        start = 0
        if row % per_micro == 0:
            next_id = 0  # ids unique in the micro-batch
        for seg in pack:
            for (index, first, last), loss in zip(seg.pieces, seg.in_loss):
                valid, adv = (bool(sample_valid[index]), float(advantages[index])) if loss else (False, 0.0)
                n = rows.put(row, start, samples[index], valid, adv, first, last)
                seq_ids[row, start:start + n] = next_id  # a branch, a prefix or a whole sequence
                start, next_id = start + n, next_id + 1
        seq_ids[row, start:] = next_id  # the pad tail: a sequence of its own, never in the loss
        next_id += 1
    masks = torch.cat([tree_mask([seg.tree for seg in pack], s) for pack in packs])
    return [rows.microbatch(slice(k, k + per_micro), seq_ids[k:k + per_micro], masks[k:k + per_micro]).to(device)
            for k in range(0, len(packs), per_micro)]
