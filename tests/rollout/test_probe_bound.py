"""``rollout.probes.probe_bound``: the derived tolerance of the refresh probe (an fp32 engine against the trainer's
exact log-softmax of the same weights), by hand and against fp32 arithmetic it must cover; and which tolerance a run
uses."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.rollout._types import PROBE_ATOL, probe_bound
from megatron_offgrpo.sampler._builders import verify_tolerance

U = 2.0 ** -24


def test_the_bound_by_hand():
    # gamma_n = n u / (1 - n u): V = 2 -> gamma_1 from the sum; H = 1 -> 4 gamma_1 per unit of logit bound
    g1 = U / (1 - U)
    assert probe_bound(2, 1, 0.0) == pytest.approx(g1, rel=1e-12)
    assert probe_bound(2, 1, 3.0) == pytest.approx(g1 + 4 * g1 * 3.0, rel=1e-12)
    # Qwen's vocabulary alone: gamma_151935 = 9.06e-3, the logit part linear in the scale
    assert probe_bound(151_936, 128, 0.0) == pytest.approx(151_935 * U / (1 - 151_935 * U), rel=1e-12)
    assert probe_bound(151_936, 128, 20.0) - probe_bound(151_936, 128, 10.0) == pytest.approx(
        40 * 128 * U / (1 - 128 * U), rel=1e-9)


@pytest.mark.parametrize("args", [(0, 8, 1.0), (10, 0, 1.0), (10, 8, -1.0), (10, 8, math.nan)])
def test_the_bound_refuses_meaningless_sizes(args):
    with pytest.raises(ValueError, match="probe_bound"):
        probe_bound(*args)


@pytest.mark.parametrize("vocab, hidden, scale, flat", [(151_936, 128, 4.0, True), (151_936, 64, 30.0, False),
                                                        (50_000, 256, 8.0, True)],
                         ids=["qwen-vocab-flat", "qwen-vocab-spread", "flat-50k"])
def test_fp32_log_softmax_of_fp32_logits_stays_inside_the_bound(vocab, hidden, scale, flat):
    # what an engine computes (fp32 logits, fp32 log-softmax) against the trainer's probe (float64 log-softmax of
    # the logits): "flat" gives most of the vocabulary one logit, as an untrained row block does (the sum's rounding
    # then piles up one way: the case that broke TP2's verification at atol 1e-4)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(8, hidden, generator=gen)
    h = h / h.norm(dim=1, keepdim=True) * scale
    w = torch.randn(vocab, hidden, generator=gen) / hidden ** 0.5
    if flat:
        w[1000:] = w[1000]  # one shared row
    targets = torch.randint(0, vocab, (8,), generator=gen)
    engine = torch.log_softmax(h @ w.t(), -1).gather(1, targets[:, None]).squeeze(1).double()
    exact = torch.log_softmax((h.double() @ w.double().t()), -1).gather(1, targets[:, None]).squeeze(1)
    bound = probe_bound(vocab, hidden, (h.norm(dim=1).max() * w.norm(dim=1).max()).item())
    err = (engine - exact).abs().max().item()
    assert err <= bound, (err, bound)
    assert bound < 0.05  # still far below what a wrong tensor moves (> 0.1: tests/rollout/scenarios.py)


def test_a_run_uses_the_derived_bound_serving_fp32_and_the_table_otherwise():
    derived = probe_bound(151_936, 128, 15.0)
    assert verify_tolerance(RolloutConfig(), "fp32", derived) == derived
    assert verify_tolerance(RolloutConfig(verify_tolerance=0.5), "fp32", derived) == 0.5  # the user's value wins
    assert verify_tolerance(RolloutConfig(), "bf16", derived) == PROBE_ATOL[torch.bfloat16]  # bf16: its table value
    assert verify_tolerance(RolloutConfig(dtype="bfloat16"), "fp32", derived) == PROBE_ATOL[torch.bfloat16]
    assert verify_tolerance(RolloutConfig(), "fp32") == PROBE_ATOL[torch.float32]  # no model at hand
