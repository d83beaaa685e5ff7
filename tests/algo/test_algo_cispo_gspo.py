"""CISPO and GSPO: values and gradients by hand, and their defining properties against grpo_clip and on-policy PG."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_offgrpo.algo import ObjectiveParams, reference_loss
from megatron_offgrpo.algo._aggregate import aggregate
from megatron_offgrpo.algo._objectives import sequence_log_ratio
from megatron_offgrpo.algo._token_loss import token_loss
from tests.algo.test_algo_objectives import ADVS, RHOS, close, per_token, tensors, token_batches

F64 = torch.float64


def gspo_params(**kw) -> ObjectiveParams:
    return ObjectiveParams(objective="gspo", aggregation="seq_mean_token_mean", **kw)


def gspo_loss(logp, behavior, adv, mask, seq_ids, params):
    """Aggregated GSPO loss through algo's public pieces (what reference_loss and the kernel do)."""
    ratio = sequence_log_ratio(logp, behavior, mask, seq_ids=seq_ids)
    per, sums = token_loss(logp, behavior, adv, mask, params, seq_log_ratio=ratio)
    return aggregate(per, mask, params, seq_ids=seq_ids), sums


# behavior_logp = 0, so rho = exp(logp); trust region [0.8, 1.2]. CISPO: loss -clip(rho) A logp, gradient
# -clip(rho) A on EVERY token (the table of test_algo_objectives: tokens 1 and 2 are clipped there, kept here).
def test_cispo_by_hand():
    logp = [math.log(r) for r in RHOS]
    loss, grad, sums = per_token(ObjectiveParams(objective="cispo"), logp, [0.0] * 5, ADVS)
    weights = [1.1, 1.2, 0.8, 1.2, 0.8]  # clip(rho, 0.8, 1.2)
    close(loss, [-w * a * lp for w, a, lp in zip(weights, ADVS, logp)])
    close(grad, [-w * a for w, a in zip(weights, ADVS)])
    assert sums["clip_high_count"].item() == 2 and sums["clip_low_count"].item() == 2  # rho 1.5, 1.5 / 0.5, 0.5


def test_gspo_by_hand():
    # one sequence of two tokens, log-ratios 0.1 and 0.3: s = exp(0.2) = 1.2214, A = +1
    logp = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    behavior = logp.detach() - torch.tensor([0.1, 0.3], dtype=F64)
    adv, mask, ids = torch.ones(2, dtype=F64), torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.long)
    s = math.exp(0.2)
    loss, _ = gspo_loss(logp, behavior, adv, mask, ids, gspo_params(seq_eps_high=0.3))  # inside [.., 1.3]
    (grad,) = torch.autograd.grad(loss, logp)
    close(loss, -s)
    close(grad, [-s / 2, -s / 2])  # d(-s)/d logp_t = -s / |y|
    loss, sums = gspo_loss(logp, behavior, adv, mask, ids, gspo_params(seq_eps_high=0.1))  # s > 1.1: clipped
    assert loss.requires_grad and torch.autograd.grad(loss, logp)[0].abs().sum() == 0
    close(loss, -1.1)
    assert sums["clip_high_count"].item() == 2  # both tokens of the clipped sequence


@settings(max_examples=100, deadline=None)
@given(batch=token_batches, eps=st.sampled_from([(0.1, 0.2), (0.2, 0.28), (3e-4, 4e-4)]))
def test_gspo_on_one_token_responses_equals_token_clip(batch, eps):
    logp, behavior, adv, mask = tensors(batch)
    ids = torch.arange(logp.shape[0])  # every response is one token: s = rho
    ours, _ = gspo_loss(logp, behavior, adv, mask, ids, gspo_params(seq_eps_low=eps[0], seq_eps_high=eps[1]))
    clip = ObjectiveParams(eps_low=eps[0], eps_high=eps[1], aggregation="seq_mean_token_mean")
    ref = aggregate(token_loss(logp, behavior, adv, mask, clip)[0], mask, clip, seq_ids=ids)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0],
                               rtol=1e-12, atol=1e-15)


@settings(max_examples=60, deadline=None)
@given(log_rho=st.floats(-0.5, 0.5), adv=st.sampled_from([-1.5, -0.3, 0.7, 2.0]), length=st.integers(1, 6))
def test_gspo_with_equal_token_ratios_equals_token_clip(log_rho, adv, length):
    # a sequence whose tokens all have ratio rho has s = rho: GSPO's loss and gradient are token-level clipping's
    logp = torch.linspace(-2.0, -0.1, length, dtype=F64).requires_grad_(True)
    behavior = logp.detach() - log_rho
    a, mask = torch.full((length,), adv, dtype=F64), torch.ones(length, dtype=torch.bool)
    ids = torch.zeros(length, dtype=torch.long)
    ours, _ = gspo_loss(logp, behavior, a, mask, ids, gspo_params(seq_eps_low=0.1, seq_eps_high=0.2))
    clip = ObjectiveParams(eps_low=0.1, eps_high=0.2, aggregation="seq_mean_token_mean")
    ref = aggregate(token_loss(logp, behavior, a, mask, clip)[0], mask, clip, seq_ids=ids)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0],
                               rtol=1e-12, atol=1e-15)


@settings(max_examples=100, deadline=None)
@given(batch=token_batches, eps_high=st.sampled_from([0.1, 0.28]))
def test_cispo_never_drops_a_clipped_tokens_gradient(batch, eps_high):
    logp, behavior, adv, mask = tensors(batch)
    params = ObjectiveParams(objective="cispo", eps_high=eps_high)
    loss, _ = token_loss(logp, behavior, adv, mask, params)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    rho = torch.exp(logp.detach() - behavior)
    live = mask & (adv != 0)
    assert (grad[live] != 0).all()  # where grpo_clip's would be 0 too
    torch.testing.assert_close(grad[live], -adv[live] * rho[live].clamp(0.8, 1 + eps_high), rtol=1e-12, atol=0)
    assert (grad[~mask] == 0).all()


@settings(max_examples=60, deadline=None)
@given(batch=token_batches, seqs=st.integers(1, 4))
@pytest.mark.parametrize("params", [ObjectiveParams(objective="cispo"), gspo_params()], ids=["cispo", "gspo"])
def test_on_policy_identity(params, batch, seqs):
    # v = 1 with exact behavior log-probs (rho = 1): the update is the on-policy policy gradient -A grad logp
    logp, _, adv, mask = tensors(batch)
    n = logp.shape[0]
    ids = torch.arange(n) * seqs // n  # seqs contiguous sequences (fewer when n < seqs)
    ratio = sequence_log_ratio(logp, logp.detach(), mask, seq_ids=ids)
    per, sums = token_loss(logp, logp.detach(), adv, mask, params, seq_log_ratio=ratio)
    (grad,) = torch.autograd.grad(aggregate(per, mask, params, seq_ids=ids), logp)
    pg = torch.where(mask, -adv, torch.zeros((), dtype=F64)) * logp
    (expected,) = torch.autograd.grad(aggregate(pg, mask, params, seq_ids=ids), logp)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert sums["clip_low_count"].item() == 0 and sums["clip_high_count"].item() == 0


def test_reference_loss_computes_the_sequence_ratio_itself():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=F64, requires_grad=True)
    targets, ids = torch.randint(0, 11, (6,)), torch.tensor([0, 0, 0, 1, 1, 1])
    mask, adv = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.bool), torch.tensor([1.0] * 3 + [-1.0] * 3, dtype=F64)
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    behavior = (logp - torch.tensor([0.01, -0.02, 0.03, 0.02, 0.0, 9.0], dtype=F64)).detach()
    params = gspo_params(seq_eps_low=0.05, seq_eps_high=0.05)
    loss, _ = reference_loss(logits, targets, behavior, adv, mask, params, seq_ids=ids)
    ours, _ = gspo_loss(logp, behavior, adv, mask, ids, params)
    torch.testing.assert_close(loss, ours, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs seq_log_ratio"):
        token_loss(logp, behavior, adv, mask, params)
