"""Group advantages: hand-computed cases per switch, properties, and bad inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_offgrpo.algo import AdvantageParams, compute_group_advantages

F64 = torch.float64


def r64(*rows):
    return torch.tensor(rows, dtype=F64)


# One informative group r = [1, 0, 0, 0]: mean = 0.25, centred = [0.75, -0.25, -0.25, -0.25],
# sum of squares = 0.75^2 + 3 * 0.25^2 = 0.75, population var = 0.75 / 4 = 0.1875, unbiased var = 0.75 / 3 = 0.25.
ONE_HOT = [1.0, 0.0, 0.0, 0.0]


def test_seed_form_population_variance():
    out = compute_group_advantages(r64(ONE_HOT), 4, AdvantageParams(form="sqrt_var", eps=1e-6))
    denom = math.sqrt(0.1875 + 1e-6)  # sqrt(var_pop + eps) = 0.43301...
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64) / denom  # ~[1.732, -0.577, ...]
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(out.group_denominator, torch.tensor([denom], dtype=F64))
    assert out.sample_valid.all() and out.group_valid.all()


def test_std_eps_form_unbiased_std():
    out = compute_group_advantages(r64(ONE_HOT), 4, AdvantageParams(form="std_eps", eps=1e-6))
    # std_unbiased = sqrt(0.25) = 0.5 -> A = centred / (0.5 + 1e-6) ~ [1.5, -0.5, -0.5, -0.5]
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64) / (0.5 + 1e-6)
    torch.testing.assert_close(out.advantages, expected, rtol=1e-12, atol=0)


def test_dr_grpo_no_std_normalisation():
    out = compute_group_advantages(r64(ONE_HOT), 4, AdvantageParams(std_normalize=False))
    torch.testing.assert_close(out.advantages, torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64))


def test_leave_one_out_baseline():
    out = compute_group_advantages(r64(ONE_HOT), 4, AdvantageParams(std_normalize=False, leave_one_out=True))
    # A_0 = 1 - mean(0, 0, 0) = 1; A_1 = 0 - mean(1, 0, 0) = -1/3
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=F64))


def test_leave_one_out_with_seed_normalisation():
    out = compute_group_advantages(r64(ONE_HOT), 4, AdvantageParams(leave_one_out=True, eps=0.0))
    # numerator 4/3 * centred = [1, -1/3, ...]; denominator sqrt(var_pop) = sqrt(0.1875)
    expected = torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=F64) / math.sqrt(0.1875)
    torch.testing.assert_close(out.advantages, expected)


def test_zero_variance_group_is_masked_and_reported():
    rewards = r64(ONE_HOT, [1.0, 1.0, 1.0, 1.0])  # [B=2, G=4]; group 1 is all-equal
    out = compute_group_advantages(rewards, 4, AdvantageParams(std_normalize=False))
    assert out.group_valid.tolist() == [True, False]
    assert out.sample_valid.tolist() == [True] * 4 + [False] * 4
    assert out.advantages[4:].tolist() == [0.0] * 4
    assert out.masked_group_fraction.item() == 0.5 and out.zero_variance_fraction.item() == 0.5


def test_zero_variance_masking_off_is_plain_grpo():
    rewards = r64(ONE_HOT, [0.1, 0.1, 0.1, 0.1])  # 0.1 * 4 / 4 may round: the advantage is still exactly 0
    out = compute_group_advantages(rewards, 4, AdvantageParams(mask_zero_variance=False, eps=0.0))
    assert out.sample_valid.all()  # the group stays in the normaliser
    assert out.advantages[4:].tolist() == [0.0] * 4  # eps = 0 and var = 0: no 0/0, exactly zero
    assert out.masked_group_fraction.item() == 0.0 and out.zero_variance_fraction.item() == 0.5


def test_gpg_scale():
    rewards = r64(ONE_HOT, [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0])  # B = 3, #valid = 2
    out = compute_group_advantages(rewards, 4, AdvantageParams(std_normalize=False, gpg_scale=True))
    assert out.scale.item() == 1.5  # 3 / max(1, 2)
    torch.testing.assert_close(out.advantages[:4], 1.5 * torch.tensor([0.75, -0.25, -0.25, -0.25], dtype=F64))
    torch.testing.assert_close(out.advantages[8:], 1.5 * torch.tensor([-0.5, 0.5, 0.5, -0.5], dtype=F64))


def test_gpg_scale_all_groups_zero_variance():
    out = compute_group_advantages(r64([1.0, 1.0], [0.0, 0.0]), 2, AdvantageParams(gpg_scale=True))
    assert out.scale.item() == 2.0  # 2 / max(1, 0)
    assert out.advantages.tolist() == [0.0] * 4 and not out.sample_valid.any()


def test_red_drop_drops_surplus_negatives_and_recomputes_mean():
    # [1, 0, 0, 0]: mean 0.25, 1 positive (r >= mean), 3 negatives -> drop 2 (the highest-index ones: 2, 3).
    # Kept [1, 0]: mean 0.5, var_pop 0.25 -> A = [0.5, -0.5] / sqrt(0.25) = [1, -1].
    # [1, 1, 0, 0] is balanced and [1, 1, 1, 0] has fewer negatives: nothing dropped there.
    rewards = r64(ONE_HOT, [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0])
    out = compute_group_advantages(rewards, 4, AdvantageParams(red_drop=True, eps=0.0))
    assert out.dropped.tolist() == [False, False, True, True] + [False] * 8
    assert out.sample_valid.tolist() == [True, True, False, False] + [True] * 8
    torch.testing.assert_close(out.advantages[:4], torch.tensor([1.0, -1.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(out.group_mean, torch.tensor([0.5, 0.5, 0.75], dtype=F64))
    torch.testing.assert_close(out.dropped_fraction, torch.tensor(2 / 12, dtype=F64))


def test_red_drop_with_generator_drops_random_negatives():
    gen = torch.Generator().manual_seed(0)
    rewards = r64([1.0] + [0.0] * 7)  # 1 positive, 7 negatives -> 6 dropped
    seen = set()
    for _ in range(10):
        out = compute_group_advantages(rewards, 8, AdvantageParams(red_drop=True), generator=gen)
        dropped = out.dropped.nonzero().flatten().tolist()
        assert len(dropped) == 6 and 0 not in dropped
        seen.add(tuple(dropped))
    assert len(seen) > 1


def test_input_shapes_and_dtypes():
    flat = compute_group_advantages(torch.tensor([1, 0, 1, 1]), 2)  # int rewards -> default float
    assert flat.advantages.dtype == torch.get_default_dtype() and flat.advantages.shape == (4,)
    two_d = compute_group_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]]), 2)
    torch.testing.assert_close(two_d.advantages, flat.advantages)
    assert compute_group_advantages(torch.tensor([True, False]), 2).advantages.shape == (2,)


@pytest.mark.parametrize(
    "rewards, group_size, needle",
    [
        (torch.tensor([1.0, 0.0, 1.0]), 2, "not a multiple of group_size=2"),
        (torch.tensor([1.0, 0.0]), 1, "group_size=1"),
        (torch.tensor([1.0, 0.0]), 0, "group_size=0"),
        (torch.tensor([1.0, 0.0]), True, "group_size=True"),
        (torch.tensor([]), 2, "empty"),
        (torch.tensor([1.0, float("nan")]), 2, r"non-finite value\(s\) \(NaN/inf\) at flat index \[1\]"),
        (torch.tensor([float("inf"), 0.0, 1.0, 0.0]), 2, r"at flat index \[0\]"),
        (torch.zeros(2, 3), 2, "second dim of"),
        (torch.zeros(2, 2, 2), 2, "must be"),
        ([1.0, 0.0], 2, "must be a torch.Tensor"),
        (torch.tensor([1.0 + 0j, 0.0]), 2, "must be real"),
    ],
)
def test_bad_inputs_raise_clear_errors(rewards, group_size, needle):
    with pytest.raises(ValueError, match=needle):
        compute_group_advantages(rewards, group_size)


reward_groups = st.integers(1, 4).flatmap(
    lambda b: st.integers(2, 6).flatmap(
        lambda g: st.tuples(
            st.just(g),
            st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -1.0, 3.0]), min_size=b * g, max_size=b * g),
        )
    )
)


@settings(max_examples=80, deadline=None)
@given(data=reward_groups, red_drop=st.booleans(), loo=st.booleans(), form=st.sampled_from(["sqrt_var", "std_eps"]))
def test_properties(data, red_drop, loo, form):
    g, values = data
    rewards = torch.tensor(values, dtype=F64).reshape(-1, g)
    params = AdvantageParams(form=form, eps=0.0, red_drop=red_drop, leave_one_out=loo)
    out = compute_group_advantages(rewards, g, params)
    adv = out.advantages.reshape(-1, g)
    keep = ~out.dropped.reshape(-1, g)
    assert torch.isfinite(adv).all()
    for b in range(rewards.shape[0]):
        if rewards[b].max() == rewards[b].min():  # zero variance: masked, exactly zero, nothing dropped
            assert not out.group_valid[b] and (adv[b] == 0).all() and keep[b].all()
            assert not out.sample_valid.reshape(-1, g)[b].any()
            continue
        kept = adv[b][keep[b]]
        assert (adv[b][~keep[b]] == 0).all()
        assert abs(float(kept.sum())) < 1e-9  # centred (LOO scales the centred rewards by k / (k - 1))
        if not loo and form == "sqrt_var":
            assert abs(float(kept.pow(2).mean()) - 1.0) < 1e-9  # unit population variance when eps = 0
        r_kept = rewards[b][keep[b]]
        original_mean = rewards[b].mean()
        if red_drop:
            assert int((r_kept < original_mean).sum()) <= int((r_kept >= original_mean).sum())
        # order is preserved: a higher reward never gets a lower advantage
        order = torch.argsort(r_kept)
        assert (kept[order].diff() >= -1e-12).all()
