"""A teacher's fleet scores the samples (``Sample.teacher_logprobs``); every layout (padded, packed, shared prompt)
puts each response token's teacher log-prob at the position that predicts it (``MicroBatch.teacher_logp``), and
the trainer's distillation reads them there as it reads its own teacher's (``train._teacher.Teacher``)."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.train._batch import build_microbatches
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches
from megatron_offgrpo.train._teacher import Teacher

BUILDS = {"padded": build_microbatches, "packed": build_packed_microbatches,
          "shared_prompt": build_shared_prompt_microbatches}


def _teacher_logp(token: int) -> float:
    return -token / 1000.0  # a value that names its token


def _samples(scored: bool = True) -> list[Sample]:
    out = []
    for i in range(4):
        response = list(range(200 + 10 * i, 203 + 10 * i + i))  # lengths 3..6
        out.append(Sample(f"p{i // 2}", i // 2, [1, 2, 3 + i // 2], response, [-0.5] * len(response), 0, "stop",
                          reward=float(i % 2),
                          teacher_logprobs=[_teacher_logp(t) for t in response] if scored else None))
    return out


@pytest.mark.parametrize("layout", list(BUILDS))
def test_each_teacher_log_prob_sits_where_its_token_is_predicted(layout):
    mbs = BUILDS[layout](_samples(), torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.ones(4, dtype=torch.bool), 2,
                         token_budget=64)
    seen = 0
    for mb in mbs:
        mask = mb.loss_mask
        assert torch.equal(mb.teacher_logp[mask], -mb.targets[mask].float() / 1000.0)
        seen += int(mask.sum())
    assert seen == sum(len(s.response_ids) for s in _samples())


@pytest.fixture(scope="module")
def ctx():
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    yield init_parallel(1, 1, seed=3)
    destroy_parallel()


def test_the_trainers_distillation_reads_the_fleets_scores(ctx):
    """Teacher.apply without a model (distill.teacher_fleet): the advantages and ``teacher_kl`` from the scores the
    micro-batch carries, as ``algo.distill_advantages`` makes them from a teacher on the trainer's ranks."""
    samples = _samples()
    (mb,) = build_microbatches(samples, torch.zeros(4), torch.ones(4, dtype=torch.bool), 2, token_budget=64)
    metrics = Teacher(None, weight=1.0, reward_weight=0.0, discount=0.0).apply(ctx, [mb], temperature=1.0)
    mask = mb.loss_mask
    expected = mb.teacher_logp[mask] - mb.behavior_logp[mask]  # log pi_teacher - log pi_behavior, per token
    assert torch.allclose(mb.advantages[mask], expected)
    assert metrics["teacher_kl"] == pytest.approx(float((-expected).mean())) and "teacher_s" not in metrics


def test_samples_with_and_without_scores_are_refused():
    samples = _samples()
    samples[1].teacher_logprobs = None
    with pytest.raises(ValueError, match="some samples carry the teacher's log-probs"):
        build_microbatches(samples, torch.zeros(4), torch.ones(4, dtype=torch.bool), 2, token_budget=64)
    with pytest.raises(ValueError, match="teacher log-probs for 3 response tokens"):
        Sample("p", 0, [1], [2, 3, 4], [-1.0] * 3, 0, "stop", teacher_logprobs=[-1.0])
