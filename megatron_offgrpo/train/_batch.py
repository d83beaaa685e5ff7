"""Samples -> the padded micro-batches one data-parallel rank trains on.

Layout: each micro-batch is ``[b, s]`` batch-first (megatron transposes inside), right-padded, with the same
``b`` and ``s`` for every micro-batch of the step so the pipeline schedule's fixed-shape p2p works. Position ``t``
predicts token ``t + 1``; ``loss_mask[t]`` is True where token ``t + 1`` is a response token of a valid sample that
the model sampled (a multi-turn episode's environment tokens are not).
Groups (all G samples of a prompt) are dealt to DP ranks round-robin, so every rank sees whole groups. A step whose
group count is not a multiple of DP deals them unevenly (3 groups over 2 ranks: 2 and 1; 1 group: 1 and 0): every
rank still gets the same micro-batch shapes and count, the short ranks' extra rows pads outside the loss, and the
loss normalisers are the step's global counts, so the gradient is the whole batch's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from megatron_offgrpo.data import Sample


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch.

    Shape notation: b samples, s positions.

    Attributes:
        tokens: [b, s] input ids (pad = 0). positions: [b, s]. targets: [b, s] next token (0 where masked).
        loss_mask: [b, s] bool, True = the next token is a response token of a valid sample (enters the loss).
        behavior_logp: [b, s] the behavior policy's log-prob of the target. advantages: [b, s].
        fleet_logp: [b, s] the engine's log-prob (equals behavior_logp unless behavior is recomputed).
        seq_ids: [b, s] row of the position (a sequence id local to the micro-batch, for per-sequence means).
        ref_logp: [b, s] reference-policy log-probs (set by the trainer when the KL term is on).
        teacher_logp: [b, s] on-policy distillation's teacher log-probs of the targets, when the samples carry them
            (a teacher's fleet scored them: ``Sample.teacher_logprobs``); None otherwise.
        attention_mask: [b, 1, s, s] bool, True = masked (megatron's convention), for packed rows
            (``_packing.block_causal_mask``); None = plain causal attention over each row.
        routed_experts: [b, s, layers, top_k] the engine's experts of each position (router replay), pad positions
            routed to experts 0..k-1; None = the trainer's routers choose.
        padding: [b, s] bool, True = a pad position (no sample's token there): MoE routers leave it out of their
            load-balancing loss and the router metrics; None = no pads.
        loss_rows: [n] the flat indices (``flat`` order) where ``loss_mask`` is True, and target_bounds: the least
            and greatest target id there (None when n = 0). Both are found on the CPU when the micro-batch is
            built, so the step never asks the device for them: on CUDA either would be a host synchronisation per
            micro-batch (``train._step``). None (a micro-batch built by hand): the step finds the rows itself.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logp: torch.Tensor
    advantages: torch.Tensor
    fleet_logp: torch.Tensor
    seq_ids: torch.Tensor
    ref_logp: torch.Tensor | None = None
    teacher_logp: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    padding: torch.Tensor | None = None
    loss_rows: torch.Tensor | None = None
    target_bounds: tuple[int, int] | None = None

    def flat(self, name: str) -> torch.Tensor:
        """A field as ``[b * s]`` in the order of ``hidden.reshape(-1, H)`` of a ``[b, s, H]`` output."""
        return getattr(self, name).reshape(-1)

    def to(self, device: torch.device | str) -> "MicroBatch":
        """This micro-batch with every tensor on ``device`` (dtypes kept; a tensor already there is not copied).

        The one place that moves a micro-batch: the step runs where the model lives (``ParallelContext.device``),
        and NCCL collectives and megatron's forward need every input there.
        """
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def check_targets(self, vocab: int) -> None:
        """Raise a ValueError when a target id of the loss is outside ``[0, vocab)`` (from ``target_bounds``, read
        on the host: no device work)."""
        if self.target_bounds is not None and not (0 <= self.target_bounds[0] and self.target_bounds[1] < vocab):
            low, high = self.target_bounds
            raise ValueError(f"target ids of the loss span [{low}, {high}] but the model's vocabulary has {vocab} "
                             "ids: the engine's tokenizer does not match the model's (check model.hf_path and the "
                             "fleet's --model)")


@dataclasses.dataclass
class StepRows:
    """The per-position tensors of a step's rows (``[rows, s]`` each), filled on the CPU one sample at a time by
    every layout (padded here, packed in ``_packing``, shared-prompt in ``_shared_prompt``); each micro-batch is a
    slice of rows, moved once."""

    tokens: torch.Tensor
    targets: torch.Tensor
    positions: torch.Tensor
    loss_mask: torch.Tensor
    behavior: torch.Tensor
    advantages: torch.Tensor
    filled: torch.Tensor
    routing: torch.Tensor | None = None
    teacher: torch.Tensor | None = None

    @classmethod
    def zeros(cls, rows: int, s: int, samples: Sequence[Sample] = ()) -> "StepRows":
        """Empty rows; with routing rows (``[rows, s, layers, k]``, pads routed to experts 0..k-1) when the step's
        ``samples`` carry the engine's routing, and teacher log-prob rows when they carry a teacher's."""
        long, shape = torch.long, (rows, s)
        routed = [x.routed_experts for x in samples if x.routed_experts is not None]
        if routed and len(routed) != len(samples):
            raise ValueError("router replay: some samples carry the engine's routing and some do not")
        routing = None
        if routed:
            layers, k = routed[0].shape[1:]
            routing = torch.arange(k, dtype=torch.int16).expand(rows, s, layers, k).clone()
        scored = [x.teacher_logprobs is not None for x in samples]
        if any(scored) and not all(scored):
            raise ValueError("distillation: some samples carry the teacher's log-probs and some do not")
        return cls(torch.zeros(shape, dtype=long), torch.zeros(shape, dtype=long), torch.zeros(shape, dtype=long),
                   torch.zeros(shape, dtype=torch.bool), torch.zeros(shape), torch.zeros(shape),
                   torch.zeros(shape, dtype=torch.bool), routing, torch.zeros(shape) if any(scored) else None)

    def put(self, row: int, start: int, sample: Sample, valid: bool, advantage: float, first: int = 0,
            last: int | None = None) -> int:
        """Write positions ``first..last-1`` of ``sample`` (default all: its tokens less one, the last token predicts
        nothing) into ``row`` from ``start``, with their own positions (a whole sequence's restart at 0); returns the
        number written. The shared-prompt layout writes a prompt once (``last = P - 1``) and each sample's branch
        (``first = P - 1``) after it."""
        full = list(sample.prompt_ids) + list(sample.response_ids)
        p, end = len(sample.prompt_ids), len(full) - 1
        last = end if last is None else last
        n = last - first
        span = slice(start, start + n)
        self.tokens[row, span] = torch.tensor(full[first:last])
        self.targets[row, span] = torch.tensor(full[first + 1:last + 1])
        self.positions[row, span] = torch.arange(first, last)
        self.advantages[row, span] = advantage
        self.filled[row, span] = True
        if self.routing is not None:
            self.routing[row, span] = sample.routed_experts[first:last]
        lo, hi = max(p - 1, first), last  # the response's targets: positions p-1 .. end-1
        if hi > lo:
            response = slice(start + lo - first, start + hi - first)
            tokens = slice(lo - p + 1, hi - p + 1)  # the response tokens these positions predict
            if sample.trainable is None or not valid:
                self.loss_mask[row, response] = valid
            else:  # a multi-turn episode: the environment's tokens are context, never trained
                self.loss_mask[row, response] = torch.tensor(sample.trainable[tokens], dtype=torch.bool)
            self.behavior[row, response] = torch.tensor(sample.behavior_logprobs[tokens], dtype=torch.float32)
            if self.teacher is not None:
                self.teacher[row, response] = torch.tensor(sample.teacher_logprobs[tokens], dtype=torch.float32)
        return n

    def microbatch(self, rows: slice, seq_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> MicroBatch:
        """The micro-batch of ``rows`` (on the CPU)."""
        behavior, padding, targets = self.behavior[rows], ~self.filled[rows], self.targets[rows]
        loss_rows = self.loss_mask[rows].reshape(-1).nonzero().squeeze(1)
        scored = targets.reshape(-1).index_select(0, loss_rows)
        bounds = (int(scored.min()), int(scored.max())) if scored.numel() else None
        return MicroBatch(self.tokens[rows], self.positions[rows], targets, self.loss_mask[rows], behavior,
                          self.advantages[rows], behavior.clone(), seq_ids, attention_mask=attention_mask,
                          teacher_logp=None if self.teacher is None else self.teacher[rows],
                          routed_experts=None if self.routing is None else self.routing[rows],
                          padding=padding if bool(padding.any()) else None, loss_rows=loss_rows,
                          target_bounds=bounds)


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``: a row length that sequence parallelism over ``multiple`` TP
    ranks splits evenly (the extra positions are pads, outside the loss)."""
    return -(-n // multiple) * multiple


def _layout(samples: Sequence[Sample], group_size: int, dp_size: int, token_budget: int,
            seq_multiple: int) -> tuple[int, int, int]:
    """(positions s, samples per micro-batch b, micro-batches per rank), identical on every rank: room for the most
    groups a rank is dealt (``deal_groups``), whole groups, so uneven dealing never overflows a rank's rows."""
    seq_len = round_up(max(len(s.prompt_ids) + len(s.response_ids) for s in samples) - 1, seq_multiple)
    per_rank = math.ceil(len(samples) // group_size / dp_size) * group_size
    per_micro = max(1, min(per_rank, token_budget // max(seq_len, 1)))
    return seq_len, per_micro, math.ceil(per_rank / per_micro)


def check_step(samples: Sequence[Sample], advantages: torch.Tensor, group_size: int) -> None:
    """Every layout's input check: whole groups, one advantage per sample."""
    if len(samples) % group_size or len(samples) != advantages.numel():
        raise ValueError(f"{len(samples)} samples, {advantages.numel()} advantages, group_size={group_size}: mismatch")


def deal_groups(samples: Sequence[Sample], group_size: int, dp_rank: int, dp_size: int) -> list[int]:
    """Indices (into ``samples``) of the samples of this DP rank: whole groups, dealt round-robin."""
    groups = len(samples) // group_size
    return [g * group_size + j for g in range(dp_rank, groups, dp_size) for j in range(group_size)]


def build_microbatches(
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
    """This rank's micro-batches of one step, on ``device``.

    Args:
        samples: every sample of the step (all DP ranks), grouped: sample ``i`` is in group ``i // group_size``.
        advantages: [B*G] per-sample advantages. sample_valid: [B*G] bool, True = enters the loss.
        group_size: G. dp_rank, dp_size: this rank and the DP size. token_budget: ~tokens per micro-batch.
        device: where the step runs (``ParallelContext.device``). The rows are filled on the CPU (one small write
            per sample) and each micro-batch is moved once, which is cheaper than many tiny device writes.
        seq_multiple: rows are a multiple of this many positions (tp under sequence parallelism, which splits each
            row over the TP ranks: ``train._step.sequence_shard``); the extra positions are pads.
    """
    check_step(samples, advantages, group_size)
    seq_len, per_micro, count = _layout(samples, group_size, dp_size, token_budget, seq_multiple)
    rows = StepRows.zeros(count * per_micro, seq_len, samples)
    for row, index in enumerate(deal_groups(samples, group_size, dp_rank, dp_size)):
        rows.put(row, 0, samples[index], bool(sample_valid[index]), float(advantages[index]))
    rows.positions[:] = torch.arange(seq_len)  # the pad tail too: one position row for every row
    seq_ids = torch.arange(per_micro).unsqueeze(1).expand(per_micro, seq_len).contiguous()
    return [rows.microbatch(slice(k * per_micro, (k + 1) * per_micro), seq_ids).to(device) for k in range(count)]


def global_token_count(samples: Sequence[Sample], sample_valid: torch.Tensor) -> int:
    """Valid trained response tokens of the whole step, over all DP ranks (the token-mean normaliser)."""
    return sum(s.trained_tokens() for s, ok in zip(samples, sample_valid.tolist()) if ok)


def global_seq_count(sample_valid: torch.Tensor) -> int:
    """Valid samples of the whole step (the sequence-mean normaliser)."""
    return int(sample_valid.sum())
