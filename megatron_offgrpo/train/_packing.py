"""Samples -> packed micro-batches: several sequences per row, no padding inside a pack (issue 19, item 1).

A padded micro-batch (``_batch.build_microbatches``) pads every row to the step's longest sequence; with a long tail
of response lengths most of its positions are padding. Here each micro-batch is ONE row of ``s`` positions holding
whole sequences back to back (first-fit decreasing into bins of ``token_budget`` positions), padded only at its end,
and a block-diagonal causal mask keeps every sequence to itself.

Exactness on the local spec: megatron-core computes RoPE from the row length (``position_ids`` feed only learned
absolute embeddings), so the sequences after the first of a pack see rotary angles shifted by their offset. A
rotary score depends only on the query-key offset, and the mask lets a token see its own sequence only, so the
attention equals the unpacked one up to rounding; the positions given to the stage restart at 0 per sequence for
any embedding that does read them. (TE's THD path with ``cu_seqlens`` restarts RoPE itself: the GPU half.)

Shape notation: s positions of a pack (the same for every micro-batch of a rank, for the pipeline's fixed-shape
p2p: the budget, or the longest sequence when it exceeds the budget).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import MicroBatch


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


def block_causal_mask(lengths: Sequence[int], s: int) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked (megatron's convention): position i sees j <= i of its own sequence; the
    pad positions after the last sequence see only themselves (their outputs never enter a loss)."""
    seq = torch.full((s,), -1, dtype=torch.long)
    start = 0
    for k, n in enumerate(lengths):
        seq[start:start + n] = k
        start += n
    seq[start:] = torch.arange(len(lengths), len(lengths) + s - start)  # each pad position alone
    same = seq.unsqueeze(0) == seq.unsqueeze(1)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return ~(same & causal).view(1, 1, s, s)


def build_packed_microbatches(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    sample_valid: torch.Tensor,
    group_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    token_budget: int = 4096,
    device: torch.device | str = "cpu",
) -> list[MicroBatch]:
    """This rank's packed micro-batches of one step (arguments as ``build_microbatches``; ``token_budget``: the
    positions of a pack). Groups go to DP ranks balanced by tokens, so ranks may get different numbers of packs;
    the loss normalisers stay the step's global counts, so the gradient is unchanged."""
    if len(samples) % group_size or len(samples) != advantages.numel():
        raise ValueError(f"{len(samples)} samples, {advantages.numel()} advantages, group_size={group_size}: mismatch")
    length = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples]  # positions: the last token predicts
    group_tokens = [sum(length[g * group_size:(g + 1) * group_size]) for g in range(len(samples) // group_size)]
    mine = [g * group_size + j for g in balance_groups(group_tokens, dp_size)[dp_rank] for j in range(group_size)]
    packs = [[mine[i] for i in pack] for pack in pack_lengths([length[i] for i in mine], token_budget)]
    s = max([token_budget] * bool(packs) + [length[i] for i in mine])
    out = []
    for pack in packs:
        tokens, targets = torch.zeros(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long)
        positions, seq_ids = torch.zeros(1, s, dtype=torch.long), torch.zeros(1, s, dtype=torch.long)
        loss_mask = torch.zeros(1, s, dtype=torch.bool)
        behavior, adv = torch.zeros(1, s), torch.zeros(1, s)
        start = 0
        for k, index in enumerate(pack):
            sample = samples[index]
            full = list(sample.prompt_ids) + list(sample.response_ids)
            n, p = length[index], len(sample.prompt_ids)
            span = slice(start, start + n)
            tokens[0, span], targets[0, span] = torch.tensor(full[:-1]), torch.tensor(full[1:])
            positions[0, span], seq_ids[0, span] = torch.arange(n), k
            resp = slice(start + p - 1, start + p - 1 + len(sample.response_ids))
            loss_mask[0, resp] = bool(sample_valid[index])
            behavior[0, resp] = torch.tensor(sample.behavior_logprobs, dtype=torch.float32)
            adv[0, span] = float(advantages[index])
            start += n
        seq_ids[0, start:] = len(pack)  # the pad tail: a sequence of its own, never in the loss
        mask = block_causal_mask([length[i] for i in pack], s)
        out.append(MicroBatch(tokens, positions, targets, loss_mask, behavior, adv, behavior.clone(), seq_ids,
                              attention_mask=mask).to(device))
    return out
