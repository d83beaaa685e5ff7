"""reference_loss: the oracle chain, end to end with advantages, masking and metrics."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_offgrpo.algo import (
    AdvantageParams,
    ObjectiveParams,
    broadcast_to_tokens,
    compute_group_advantages,
    reference_loss,
)

F64 = torch.float64


def test_logp_temperature_and_entropy_by_hand():
    # one token, V = 2, logits [2, 0], T = 2 -> softmax([1, 0]) = [e/(e+1), 1/(e+1)]; target 0
    # gpg, A = 1, on-policy: loss = -logp = log(1 + e^-1); entropy = -sum p log p
    logits = torch.tensor([[2.0, 0.0]], dtype=F64, requires_grad=True)
    p0 = math.e / (math.e + 1)
    logp = math.log(p0)
    loss, metrics = reference_loss(
        logits, torch.tensor([0]), torch.tensor([logp], dtype=F64), torch.tensor([1.0], dtype=F64),
        torch.tensor([True]), ObjectiveParams(objective="gpg"), temperature=2.0, compute_entropy=True,
    )
    assert loss.item() == pytest.approx(-logp)
    entropy = -(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0))
    assert metrics["entropy_mean"].item() == pytest.approx(entropy)
    loss.backward()
    # d(-log softmax(z/T)_0)/dz = -(onehot - p) / T = [-(1 - p0) / 2, p0 / 2]
    torch.testing.assert_close(logits.grad, torch.tensor([[-(1 - p0) / 2, (1 - p0) / 2]], dtype=F64))


def manual_chain(logits, targets, behavior, adv, mask, seq_ids, ref, fleet, params, temperature):
    """log_softmax -> gather -> PPO-clip written with min/clamp -> tis -> k3 -> seq-mean-token-mean."""
    logp = torch.log_softmax(logits / temperature, -1).gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    rho = torch.exp(logp - behavior)
    lo, hi = 1 - params.eps_low, 1 + params.eps_high
    pg = -torch.minimum(rho * adv, rho.clamp(lo, hi) * adv)
    seq_log_ratio = torch.zeros(int(seq_ids.max()) + 1, dtype=F64).index_add(
        0, seq_ids, torch.where(mask, behavior - fleet, 0)
    )
    tis = torch.exp(seq_log_ratio).clamp(max=params.tis_cap)[seq_ids]
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    tok = torch.where(mask, tis * pg + params.kl_beta * kl, 0)
    seq_sum = torch.zeros_like(seq_log_ratio).index_add(0, seq_ids, tok)
    seq_cnt = torch.zeros_like(seq_log_ratio).index_add(0, seq_ids, mask.to(F64))
    return (seq_sum / seq_cnt.clamp_min(1)).sum() / (seq_cnt > 0).sum()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([1.0, 0.7]))
def test_reference_equals_manual_chain(seed, temperature):
    gen = torch.Generator().manual_seed(seed)
    n, v = 9, 5
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    mask = torch.rand(n, generator=gen) > 0.2
    logits = torch.randn(n, v, generator=gen, dtype=F64)
    targets = torch.randint(0, v, (n,), generator=gen)
    base = torch.log_softmax(logits / temperature, -1).gather(1, targets[:, None]).squeeze(1)
    behavior = base + 0.4 * torch.randn(n, generator=gen, dtype=F64)  # off-policy lag
    fleet = behavior + 0.2 * torch.randn(n, generator=gen, dtype=F64)  # engine mismatch
    ref = base + 0.3 * torch.randn(n, generator=gen, dtype=F64)
    adv = broadcast_to_tokens(torch.randn(3, generator=gen, dtype=F64), seq_ids=seq_ids)
    params = ObjectiveParams(kl_beta=0.05, tis_cap=1.5, tis_level="sequence", aggregation="seq_mean_token_mean")
    ours_logits = logits.clone().requires_grad_(True)
    loss, metrics = reference_loss(
        ours_logits, targets, behavior, adv, mask, params, seq_ids=seq_ids, ref_logp=ref, fleet_logp=fleet,
        temperature=temperature,
    )
    (grad,) = torch.autograd.grad(loss, ours_logits)
    ref_logits = logits.clone().requires_grad_(True)
    expected = manual_chain(ref_logits, targets, behavior, adv, mask, seq_ids, ref, fleet, params, temperature)
    (grad_expected,) = torch.autograd.grad(expected, ref_logits)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, grad_expected, rtol=1e-10, atol=1e-12)
    assert (grad[~mask] == 0).all()
    for key in ("clip_low_fraction", "clip_high_fraction", "kl_mean", "tis_raw_mean", "tis_truncated_fraction"):
        assert key in metrics and torch.isfinite(metrics[key]) and not metrics[key].requires_grad


def batch_from_rewards(rewards, group_size, lengths, gen):
    """Packed batch: sample s has lengths[s] response tokens; logits random, behavior = current (on-policy)."""
    adv = compute_group_advantages(rewards, group_size, AdvantageParams())
    cu = torch.tensor([0] + list(lengths)).cumsum(0)
    n = int(cu[-1])
    logits = torch.randn(n, 4, generator=gen, dtype=F64)
    targets = torch.randint(0, 4, (n,), generator=gen)
    behavior = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    mask = broadcast_to_tokens(adv.sample_valid, cu_seqlens=cu)
    return logits, targets, behavior, broadcast_to_tokens(adv.advantages, cu_seqlens=cu), mask, cu, adv


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), objective=st.sampled_from(["grpo_clip", "gpg", "rec"]))
def test_masked_groups_give_zero_grad_and_do_not_change_the_rest(seed, objective):
    gen = torch.Generator().manual_seed(seed)
    g = 3
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5], dtype=F64)  # group 1 is zero-variance
    lengths = torch.randint(1, 4, (9,), generator=gen).tolist()
    logits, targets, behavior, adv, mask, cu, out = batch_from_rewards(rewards, g, lengths, gen)
    assert out.group_valid.tolist() == [True, False, True] and out.masked_group_fraction.item() == pytest.approx(1 / 3)
    params = ObjectiveParams(objective=objective)
    logits.requires_grad_(True)
    loss, _ = reference_loss(logits, targets, behavior, adv, mask, params, cu_seqlens=cu)
    loss.backward()
    group1 = slice(int(cu[3]), int(cu[6]))
    assert (logits.grad[group1] == 0).all()
    # the same loss without group 1's tokens at all
    keep = torch.ones(len(mask), dtype=torch.bool)
    keep[group1] = False
    sub_loss, _ = reference_loss(
        logits.detach()[keep], targets[keep], behavior[keep], adv[keep], mask[keep], params
    )
    torch.testing.assert_close(loss.detach(), sub_loss, rtol=1e-12, atol=1e-14)


def test_garbage_in_masked_rows_never_leaks():
    logits = torch.tensor([[0.0, 1.0], [math.nan, math.inf]], dtype=F64, requires_grad=True)
    targets = torch.tensor([1, -100])  # -100: an ignore id at the masked position
    loss, metrics = reference_loss(
        logits, targets, torch.tensor([-0.3, math.nan], dtype=F64), torch.tensor([1.0, math.nan], dtype=F64),
        torch.tensor([True, False]), ObjectiveParams(), compute_entropy=True,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all() and (logits.grad[1] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


def test_fleet_logp_without_cap_reports_but_does_not_weight():
    args = (torch.zeros(2, 3, dtype=F64), torch.tensor([0, 1]), torch.full((2,), -math.log(3), dtype=F64),
            torch.tensor([1.0, -1.0], dtype=F64), torch.tensor([True, True]))
    plain, _ = reference_loss(*args, ObjectiveParams())
    monitored, metrics = reference_loss(*args, ObjectiveParams(), fleet_logp=torch.zeros(2, dtype=F64))
    assert torch.equal(plain, monitored)
    assert metrics["tis_raw_mean"].item() == pytest.approx(1 / 3)  # exp(-log 3 - 0)
    capped, _ = reference_loss(*args, ObjectiveParams(tis_cap=2.0), fleet_logp=torch.zeros(2, dtype=F64))
    assert capped.item() == pytest.approx(plain.item() / 3)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"params": ObjectiveParams(tis_cap=2.0)}, "tis_cap=2.0 needs fleet_logp"),
        ({"logits": torch.zeros(3)}, r"logits has shape \(3,\)"),
        ({"logits": torch.zeros(3, 2, dtype=torch.long)}, "logits has dtype"),
        ({"targets": torch.zeros(3)}, "targets has dtype"),
        ({"targets": torch.zeros(2, dtype=torch.long)}, "targets has 2 entries"),
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"temperature": math.inf}, "temperature=inf"),
        ({"loss_mask": torch.ones(3)}, "loss_mask has dtype"),
        ({"params": ObjectiveParams(aggregation="seq_mean_token_mean")}, "pass exactly one of seq_ids"),
    ],
)
def test_bad_inputs(change, needle):
    args = {
        "logits": torch.zeros(3, 2),
        "targets": torch.zeros(3, dtype=torch.long),
        "behavior_logp": torch.zeros(3),
        "advantages": torch.zeros(3),
        "loss_mask": torch.ones(3, dtype=torch.bool),
        "params": ObjectiveParams(),
    } | change
    with pytest.raises(ValueError, match=needle):
        reference_loss(**args)
