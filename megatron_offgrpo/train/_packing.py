"""Samples -> packed micro-batches: several sequences per row, no padding inside a pack (issue 19, item 1).

A padded micro-batch (``_batch.build_microbatches``) pads every row to the step's longest sequence; with a long tail
of response lengths most of its positions are padding. Here a row of the same length holds whole sequences back to
back (first-fit decreasing), padded only at its end, and a block-diagonal causal mask keeps every sequence to
itself. The mask is dense ([b, 1, s, s]), so attention per position costs what a padded row's does; only the number
of positions shrinks.

Exactness on the local spec: the stage takes its rotary angles from the positions given to it, which restart at 0
per sequence (``model._rope``; megatron alone would use a token's place in the row), and the mask lets a token see
its own sequence only, so the attention equals the unpacked one up to rounding. (TE's THD path with ``cu_seqlens``
restarts RoPE itself: the GPU half, not done.)

Shape notation: s positions of a row, the step's longest sequence (as in the padded layout), the same for every
micro-batch, for the pipeline's fixed-shape p2p.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import MicroBatch, StepRows, check_step, round_up


def balance_groups(group_tokens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Group indices per DP rank, balanced by tokens: largest group first to the rank with the fewest tokens so far
    (ties: the lower rank; equal sizes keep their order). Every rank gets whole groups; ranks' lists are sorted."""
    heap = [(0, rank) for rank in range(dp_size)]
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for group in sorted(range(len(group_tokens)), key=lambda g: (-group_tokens[g], g)):
        load, rank = heapq.heappop(heap)
        out[rank].append(group)
        heapq.heappush(heap, (load + group_tokens[group], rank))
    return [sorted(groups) for groups in out]


def pack_lengths(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` per pack: first-fit decreasing into bins of ``budget`` (a length above the budget gets a
    pack of its own). Packs are returned in the order of their first (longest) item; within a pack, longest first."""
    if budget < 1:
        raise ValueError(f"token budget {budget}: must be >= 1")
    packs: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((k for k, free in enumerate(room) if free >= lengths[index]), None)
        if fit is None:
            packs.append([index])
            room.append(budget - lengths[index])
        else:
            packs[fit].append(index)
            room[fit] -= lengths[index]
    return packs


def tree_mask(segments: Sequence[tuple[int, Sequence[int]]], s: int) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked (megatron's convention), for segments ``(prefix, branches)`` laid back to back
    (each a prefix of ``prefix`` positions, then branches of the given lengths): a prefix position sees the earlier
    positions of its prefix; a branch position sees its whole prefix and the earlier positions of its own branch.
    A whole sequence is ``(length, ())``. The pad positions after the last segment see only themselves (their outputs
    never enter a loss)."""
    block = torch.empty(s, dtype=torch.long)
    branch = torch.full((s,), -1, dtype=torch.long)  # -1: a prefix position (or pad)
    start = 0
    for k, (prefix, branches) in enumerate(segments):
        block[start:start + prefix] = k
        start += prefix
        for b, n in enumerate(branches):
            block[start:start + n], branch[start:start + n] = k, b
            start += n
    block[start:] = torch.arange(len(segments), len(segments) + s - start)  # each pad position alone
    same = block.unsqueeze(1) == block.unsqueeze(0)  # [query, key]
    visible = (branch.unsqueeze(0) == -1) | (branch.unsqueeze(0) == branch.unsqueeze(1))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return ~(same & visible & causal).view(1, 1, s, s)


def block_causal_mask(lengths: Sequence[int], s: int) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked: position i sees j <= i of its own sequence (``tree_mask`` of whole
    sequences); the pad positions after the last sequence see only themselves."""
    return tree_mask([(n, ()) for n in lengths], s)


def build_packed_microbatches(
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
    """This rank's packed micro-batches of one step (arguments as ``build_microbatches``).

    Rows have the padded layout's length, the step's longest sequence ``s``, and ``token_budget // s`` rows make a
    micro-batch, as there; but each row holds as many whole sequences as fit (first-fit decreasing). Attention then
    costs what the padded layout's does per position (a row of ``s``), and there are fewer positions. Groups go to DP
    ranks balanced by tokens, so ranks may get different numbers of micro-batches; the loss normalisers stay the
    step's global counts, so the gradient is the padded layout's.
    """
    check_step(samples, advantages, group_size)
    length = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]  # positions: the last token predicts
    s = round_up(max(length), seq_multiple)  # the pad tail after the last sequence sees only itself (the mask)
    group_tokens = [sum(length[g * group_size:(g + 1) * group_size]) for g in range(len(samples) // group_size)]
    mine = [g * group_size + j for g in balance_groups(group_tokens, dp_size)[dp_rank] for j in range(group_size)]
    packs = [[mine[i] for i in pack] for pack in pack_lengths([length[i] for i in mine], s)]
    packs = packs or [[]]  # a rank dealt no group (fewer groups than DP ranks): one pad row, in no loss
    per_micro = max(1, min(len(packs), token_budget // s))
    packs += [[]] * (-len(packs) % per_micro)  # empty rows: every micro-batch has the same shape (pipeline p2p)
    rows = StepRows.zeros(len(packs), s, samples)
    seq_ids = torch.zeros(len(packs), s, dtype=torch.long)
    for row, pack in enumerate(packs):
        start = 0
        for k, index in enumerate(pack):
            n = rows.put(row, start, samples[index], bool(sample_valid[index]), float(advantages[index]))
            seq_ids[row, start:start + n] = row * s + k  # unique in the micro-batch
            start += n
        seq_ids[row, start:] = row * s + len(pack)  # the pad tail: a sequence of its own, never in the loss
    masks = torch.cat([block_causal_mask([length[i] for i in pack], s) for pack in packs])
    return [rows.microbatch(slice(k, k + per_micro), seq_ids[k:k + per_micro], masks[k:k + per_micro]).to(device)
            for k in range(0, len(packs), per_micro)]
