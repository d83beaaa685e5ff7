"""The reward model's losses and metrics on hand-worked numbers (pure; no model)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_offgrpo.rmfit import auc, bce_loss, pairwise_loss, rm_loss
from megatron_offgrpo.rmfit._metrics import accuracy, group_pairwise_accuracy, score_report


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_bce_is_softplus_of_minus_the_logit_for_right_and_of_the_logit_for_wrong():
    scores = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([True, False, False])
    # right 2.0: softplus(-2) = 0.126928; wrong -1.0: softplus(-1) = 0.313262; wrong 0.5: softplus(0.5) = 0.974077
    expected = (softplus(-2.0) + softplus(-1.0) + softplus(0.5)) / 3  # 0.471422
    assert bce_loss(scores, labels).item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.471422, abs=1e-6)


def test_pairwise_compares_right_with_wrong_inside_each_group_only():
    # group 0: right 1.0, wrong 0.0, wrong 3.0 -> pairs (1.0, 0.0), (1.0, 3.0)
    # group 1: right -2.0, right 5.0, wrong 4.0 -> pairs (-2.0, 4.0), (5.0, 4.0)
    # never across groups: right 5.0 (group 1) against wrong 0.0 (group 0) is no pair
    scores = torch.tensor([1.0, 0.0, 3.0, -2.0, 5.0, 4.0])
    labels = torch.tensor([True, False, False, True, True, False])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    # softplus(s_wrong - s_right): softplus(-1) = 0.313262, softplus(2) = 2.126928, softplus(6) = 6.002476,
    # softplus(-1) = 0.313262; mean 2.188982
    expected = (softplus(-1.0) + softplus(2.0) + softplus(6.0) + softplus(-1.0)) / 4
    assert pairwise_loss(scores, labels, groups).item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(2.188982, abs=1e-6)
    assert rm_loss("pairwise", scores, labels, groups).item() == pytest.approx(expected, abs=1e-6)


def test_a_batch_without_a_pair_has_zero_loss_and_a_zero_gradient():
    scores = torch.tensor([1.0, 2.0, -1.0], requires_grad=True)
    loss = pairwise_loss(scores, torch.tensor([True, True, False]), torch.tensor([0, 0, 1]))  # the wrong one alone
    loss.backward()
    assert loss.item() == 0.0 and scores.grad.abs().sum().item() == 0.0


def test_the_pairwise_gradient_pushes_right_up_and_wrong_down():
    scores = torch.tensor([0.0, 0.0], requires_grad=True)
    pairwise_loss(scores, torch.tensor([True, False]), torch.tensor([0, 0])).backward()
    # d softplus(s_w - s_r) / d s_r = -sigmoid(0) = -0.5; / d s_w = +0.5
    assert scores.grad.tolist() == pytest.approx([-0.5, 0.5])


def test_an_unknown_loss_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="rm.loss='hinge'"):
        rm_loss("hinge", torch.zeros(2), torch.tensor([True, False]), torch.zeros(2))


def test_metrics_by_hand():
    scores = [2.0, -1.0, 0.5, 0.5, -3.0, 1.0]
    labels = [True, False, True, False, False, True]
    groups = [0, 0, 0, 1, 1, 1]
    # sign right: 2.0 yes, -1.0 yes, 0.5 yes, 0.5 (wrong, > 0) no, -3.0 yes, 1.0 yes -> 5 / 6
    assert accuracy(scores, labels) == pytest.approx(5 / 6)
    # right {2.0, 0.5, 1.0} x wrong {-1.0, 0.5, -3.0}: 9 pairs; only 0.5 vs 0.5 ties (a half) -> 8.5 / 9
    assert auc(scores, labels) == pytest.approx(8.5 / 9)
    # group 0: right {2.0, 0.5} x wrong {-1.0}: 2 wins; group 1: right {1.0} x wrong {0.5, -3.0}: 2 wins -> 4 / 4
    assert group_pairwise_accuracy(scores, labels, groups) == 1.0
    report = score_report(scores, labels, groups)
    assert report["majority_accuracy"] == 0.5  # 3 right, 3 wrong
    assert auc([1.0, 2.0], [True, True]) is None and group_pairwise_accuracy([1.0], [False], [0]) is None
