"""What a step's generation hands the driver (``RolloutBatch``), and DAPO's dynamic sampling: keep only groups whose
rewards differ, refill from the prompt stream until the step holds B of them, within a bounded number of rounds.

Shape notation: B = ``rollout.prompts_per_step`` groups, G = ``rollout.group_size`` samples per group.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import zlib
from typing import Callable

import torch

from megatron_offgrpo.algo import AdvantageParams, compute_group_advantages
from megatron_offgrpo.data import Sample


@dataclasses.dataclass(frozen=True)
class SamplingStats:
    """How a step's batch was filled under ``rollout.dynamic_sampling`` (counts of groups).

    ``generated = valid + degenerate_kept + dropped + surplus`` and ``valid + degenerate_kept = B``.

    Attributes:
        rounds: generation rounds the step took (1 .. ``rollout.max_sampling_rounds``).
        generated: groups generated over all rounds (prompts taken from the stream).
        valid: groups in the batch whose rewards differ (they carry a learning signal).
        dropped: groups with equal rewards that were discarded.
        degenerate_kept: groups with equal rewards kept to fill the batch when the rounds ran out (the advantages
            mask them as without dynamic sampling); 0 when the batch filled.
        surplus: groups with variance beyond B (``rollout.oversample`` > 1 asks for more than are missing).
    """

    rounds: int
    generated: int
    valid: int
    dropped: int
    degenerate_kept: int
    surplus: int

    def metrics(self) -> dict[str, float]:
        """The counts under their metric names (metrics.jsonl)."""
        return {"sampling_rounds": self.rounds, "groups_generated": self.generated, "groups_valid": self.valid,
                "groups_dropped": self.dropped, "groups_degenerate_kept": self.degenerate_kept,
                "groups_surplus": self.surplus}


@dataclasses.dataclass
class RolloutBatch:
    """One step's scored samples, group-major (B x G, ``group_id`` 0..B-1), and how they were sampled.

    Attributes:
        samples: [B*G] sample g of group b at ``b * G + g``.
        stats: the dynamic-sampling counts; None without ``rollout.dynamic_sampling`` (one round of B groups).
        timing: ``generate_s``, the seconds its generation and scoring took (in any mode: in ``rollout.mode``
            overlap and the async modes it ran beside the trainer); in the async modes (``sampler._async``) also
            ``buffer_depth`` (batches ready behind it when it was taken), ``steps_in_flight`` (steps generating then)
            and ``fleet_paused_s`` (seconds since the previous step's batch was taken that no step was generating,
            held by the staleness bound).
        episodes: multi-turn episodes' counts (``rollout.multiturn.EpisodeStats.metrics``: turns, tool errors,
            environment seconds); empty for single-turn samples.
    """

    samples: list[Sample]
    stats: SamplingStats | None = None
    timing: dict[str, float] = dataclasses.field(default_factory=dict)
    episodes: dict[str, float] = dataclasses.field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Rank 0's sampling metrics: the dynamic-sampling counts, ``timing`` and ``episodes``."""
        return ({} if self.stats is None else self.stats.metrics()) | self.timing | self.episodes


class NoLearningSignalError(RuntimeError):
    """A step under dynamic sampling found no group whose rewards differ: nothing to train on."""


def round_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of generation round ``round_`` of ``step`` (engines add the group index).

    Round 0 keeps the seed of a run without dynamic sampling (so a step whose first round fills is the same batch);
    refill rounds take a CRC of (seed, step, round): distinct per round and reproducible, where an affine formula
    would let round r of step s reuse the seeds of a later step's first round.
    """
    if round_ == 0:
        return seed + 100_003 * step
    return zlib.crc32(f"{seed}/{step}/{round_}".encode())


def fill_batch(draw: Callable[[int, int], list[Sample]], batch_groups: int, group_size: int, max_rounds: int,
               oversample: float, params: AdvantageParams, step: int) -> RolloutBatch:
    """DAPO's dynamic sampling: draw rounds of groups until ``batch_groups`` of them have reward variance.

    A group has variance when algo's advantages say so (``GroupAdvantages.group_valid``, ``max(r) != min(r)``):
    the filter and the zero-variance mask can never disagree. Round r asks for ``ceil(missing x oversample)``
    prompts. When ``max_rounds`` run out first, the earliest discarded groups top the batch up to B (masked by the
    advantages like any zero-variance group), so the batch keeps its B x G shape.

    Args:
        draw: ``draw(round, prompts)`` -> the next ``prompts`` prompts of the stream, G scored samples each,
            group-major with ``group_id`` 0..prompts-1.
        batch_groups: B. group_size: G. max_rounds: most rounds (>= 1). oversample: >= 1.
        params: the run's advantage switches. step: the trainer step (for the error message).

    Returns:
        B groups in the order they were drawn, renumbered ``group_id`` 0..B-1, with the counts.

    Raises:
        NoLearningSignalError: no group of any round had variance.
    """
    kept: list[tuple[int, list[Sample]]] = []  # (draw order, group) with variance
    spare: list[tuple[int, list[Sample]]] = []  # (draw order, group) with equal rewards
    rounds = 0
    while len(kept) < batch_groups and rounds < max_rounds:
        asked = math.ceil((batch_groups - len(kept)) * oversample)
        groups = _split_groups(draw(rounds, asked), asked, group_size)
        rewards = torch.tensor([[s.reward for s in group] for group in groups], dtype=torch.float64)
        variance = compute_group_advantages(rewards, group_size, params).group_valid.tolist()
        for group, has_variance in zip(groups, variance):
            (kept if has_variance else spare).append((len(kept) + len(spare), group))
        rounds += 1
    generated = len(kept) + len(spare)
    if not kept:
        raise NoLearningSignalError(_no_signal_message(spare, step, rounds, max_rounds, group_size))
    fill = spare[: max(0, batch_groups - len(kept))]
    chosen = sorted(kept[:batch_groups] + fill, key=lambda item: item[0])
    samples = []
    for group_id, (_, group) in enumerate(chosen):
        for sample in group:
            sample.group_id = group_id
        samples.extend(group)
    stats = SamplingStats(rounds=rounds, generated=generated, valid=min(len(kept), batch_groups),
                          dropped=len(spare) - len(fill), degenerate_kept=len(fill),
                          surplus=max(0, len(kept) - batch_groups))
    return RolloutBatch(samples, stats)


def _split_groups(samples: list[Sample], prompts: int, group_size: int) -> list[list[Sample]]:
    """``samples`` (``prompts`` x G of them: ``RolloutSide._draw`` checks the count) as groups of G, checking the
    engine's group-major order (the renumbering relies on it)."""
    groups = [samples[b * group_size:(b + 1) * group_size] for b in range(prompts)]
    for b, group in enumerate(groups):
        if any(s.group_id != b for s in group):
            raise RuntimeError(f"engine samples are not group-major: group {b} holds group_ids "
                               f"{sorted({s.group_id for s in group})}")
    return groups


def _no_signal_message(spare: list[tuple[int, list[Sample]]], step: int, rounds: int, max_rounds: int,
                       group_size: int) -> str:
    """One line: how many groups scored which constant, what that says about the task, and what to change."""
    constants = collections.Counter(float(group[0].reward) for _, group in spare)
    counts = ", ".join(f"{n} all {value}" for value, n in sorted(constants.items()))
    if set(constants) == {0.0}:
        cause = ("the task is too hard for the policy (no completion scored): give easier prompts (data.*), a "
                 "warmed-up policy (offgrpo sft), or more tries (rollout.group_size, rollout.max_sampling_rounds)")
    elif set(constants) == {1.0}:
        cause = ("the task is too easy for the policy (every completion scored): give harder prompts (data.*) or "
                 "raise rollout.temperature")
    elif set(constants) <= {0.0, 1.0}:
        cause = ("each prompt is either always solved or never: the G samples agree, raise rollout.temperature or "
                 "rollout.group_size")
    else:
        cause = ("the reward gives every completion of a prompt the same value: check that data.reward reads the "
                 "completion")
    return (f"step {step}: dynamic sampling found no group with reward variance in {rounds} round(s) "
            f"(rollout.max_sampling_rounds={max_rounds}): of {len(spare)} groups of G={group_size}, {counts}; {cause}")
