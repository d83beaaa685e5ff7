"""Each objective's per-token values and gradients, by hand and as properties against written formulas."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_offgrpo.algo import ObjectiveParams
from megatron_offgrpo.algo._aggregate import aggregate
from megatron_offgrpo.algo._token_loss import token_loss

F64 = torch.float64
L = math.log


def per_token(params, logp, behavior, adv):
    """Returns (per-token loss, d sum(loss) / d logp, metric sums) for float64 inputs, all tokens valid."""
    logp = torch.tensor(logp, dtype=F64, requires_grad=True)
    behavior, adv = torch.tensor(behavior, dtype=F64), torch.tensor(adv, dtype=F64)
    mask = torch.ones(logp.shape, dtype=torch.bool)
    loss, sums = token_loss(logp, behavior, adv, mask, params)
    loss.sum().backward()
    return loss.detach(), logp.grad, sums


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)


# behavior_logp = 0 everywhere, so rho = exp(logp); eps_low = eps_high = 0.2: trust region [0.8, 1.2].
#   token:  A    rho   PPO-clip min(rho A, clip(rho) A)        loss    d loss / d logp = -A rho (if unclipped)
#   0      +1    1.1   inside                                  -1.1    -1.1
#   1      +1    1.5   clip(1.5) = 1.2 < 1.5: clipped high     -1.2     0
#   2      -1    0.5   clip(0.5) A = -0.8 < -0.5: clipped low   0.8     0
#   3      -1    1.5   rho A = -1.5 < -1.2: unclipped           1.5     1.5
#   4      +1    0.5   rho A = 0.5 < 0.8: unclipped            -0.5    -0.5
RHOS, ADVS = [1.1, 1.5, 0.5, 1.5, 0.5], [1.0, 1.0, -1.0, -1.0, 1.0]


def test_grpo_clip_by_hand():
    loss, grad, sums = per_token(ObjectiveParams(), [L(r) for r in RHOS], [0.0] * 5, ADVS)
    close(loss, [-1.1, -1.2, 0.8, 1.5, -0.5])
    close(grad, [-1.1, 0.0, 0.0, 1.5, -0.5])
    assert sums["clip_high_count"].item() == 1 and sums["clip_low_count"].item() == 1
    assert sums["token_count"].item() == 5 and sums["dual_clip_count"].item() == 0


def test_grpo_dual_clip_by_hand():
    # c = 3, A = -1: rho = 4 -> min(max(4, 1.2), 3) = 3, gradient 0; rho = 2 -> 2, gradient -A rho = 2;
    # A = +1, rho = 4 -> clipped high as usual (-1.2); dual clip never touches A > 0.
    params = ObjectiveParams(dual_clip=3.0)
    loss, grad, sums = per_token(params, [L(4.0), L(2.0), L(4.0)], [0.0] * 3, [-1.0, -1.0, 1.0])
    close(loss, [3.0, 2.0, -1.2])
    close(grad, [0.0, 2.0, 0.0])
    assert sums["dual_clip_count"].item() == 1


def test_gpg_by_hand():
    # loss = -A logp: A = 2, logp = -0.5 -> 1.0, grad -2; A = -1, logp = -2 -> -2, grad 1. behavior is ignored.
    loss, grad, _ = per_token(ObjectiveParams(objective="gpg"), [-0.5, -2.0], [5.0, -9.0], [2.0, -1.0])
    close(loss, [1.0, -2.0])
    close(grad, [-2.0, 1.0])


@pytest.mark.parametrize(
    "clip, weight, kept",
    [
        ("none", "none", [1, 1, 1, 1, 1]),
        ("one_side", "none", [1, 0, 0, 1, 1]),  # exactly PPO-clip's zero-gradient tokens removed
        ("two_side", "none", [1, 0, 0, 0, 0]),  # only 0.8 <= rho <= 1.2 stays
        ("one_side", "is", [1, 0, 0, 1, 1]),
    ],
)
def test_rec_by_hand(clip, weight, kept):
    # logp = log rho, loss = -w A logp m; NoIS: w = 1, grad = -A m; IS: w = rho, grad = -rho A m
    params = ObjectiveParams(objective="rec", rec_clip=clip, rec_weight=weight)
    loss, grad, _ = per_token(params, [L(r) for r in RHOS], [0.0] * 5, ADVS)
    w = RHOS if weight == "is" else [1.0] * 5
    close(loss, [-wi * a * L(r) * m for wi, a, r, m in zip(w, ADVS, RHOS, kept)])
    close(grad, [-wi * a * m for wi, a, m in zip(w, ADVS, kept)])


def test_rec_ring_by_hand():
    # eps 0.2 / 0.2, outer eps_low' = 0.6 (floor 0.4), eps_high' = 2.0 (ceiling 3.0):
    #   (A, rho)       kept?
    #   (+1, 0.3)      yes: A >= 0 and rho <= 0.4 (far below: pull a good token back up)
    #   (+1, 0.5)      no:  between 0.4 and 0.8
    #   (-1, 3.5)      yes: A <= 0 and rho >= 3.0 (far above: push a bad token back down)
    #   (-1, 2.0)      no:  between 1.2 and 3.0
    #   (+1, 3.5)      no:  A > 0 above the region is never re-admitted
    #   (-1, 0.3)      no:  A < 0 below the region is never re-admitted
    #   (+1, 1.0)      yes: inside
    rhos, advs = [0.3, 0.5, 3.5, 2.0, 3.5, 0.3, 1.0], [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    params = ObjectiveParams(objective="rec", rec_clip="ring", eps_low_outer=0.6, eps_high_outer=2.0)
    loss, grad, sums = per_token(params, [L(r) for r in rhos], [0.0] * 7, advs)
    kept = [1, 0, 1, 0, 0, 0, 1]
    close(grad, [-a * m for a, m in zip(advs, kept)])
    close(loss, [-a * L(r) * m for a, r, m in zip(advs, rhos, kept)])
    assert sums["clip_low_count"].item() == 2 and sums["clip_high_count"].item() == 2


def test_opmd_by_hand():
    # logp = -1, behavior = -1.5, A = 2, tau = 0.1: REC (none/none) = -A logp = 2;
    # regulariser tau (logp - b)^2 = 0.1 * 0.25 = 0.025; grad = -A + 2 tau (logp - b) = -2 + 0.1 = -1.9
    params = ObjectiveParams(objective="opmd", tau=0.1)
    loss, grad, _ = per_token(params, [-1.0], [-1.5], [2.0])
    close(loss, [2.025])
    close(grad, [-1.9])


def test_asymre_by_hand():
    # logp = -1, A = 2, tau = 0.1: -A logp - tau logp = 2 + 0.1 = 2.1; grad = -A - tau = -2.1
    params = ObjectiveParams(objective="asymre", tau=0.1)
    loss, grad, _ = per_token(params, [-1.0], [-3.0], [2.0])
    close(loss, [2.1])
    close(grad, [-2.1])


# ---------------------------------------------------------------- properties against written formulas
def written_loss(params, logp, b, a):
    """The objectives as the papers write them (min / clamp; independent of the library's where-form)."""
    rho = torch.exp(logp - b)
    lo, hi = 1 - params.eps_low, 1 + params.eps_high
    if params.objective == "grpo_clip":
        loss = -torch.minimum(rho * a, torch.clamp(rho, lo, hi) * a)
        if params.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -params.dual_clip * a), loss)
        return loss
    if params.objective == "gpg":
        return -a * logp
    r = rho.detach()
    m = {
        "none": torch.ones_like(r, dtype=torch.bool),
        "one_side": ~(((a > 0) & (r > hi)) | ((a < 0) & (r < lo))),
        "two_side": (r >= lo) & (r <= hi),
        "ring": ((r >= lo) & (r <= hi))
        | ((a >= 0) & (r <= 1 - params.eps_low_outer))
        | ((a <= 0) & (r >= 1 + params.eps_high_outer)),
    }[params.rec_clip]
    w = r if params.rec_weight == "is" else 1.0
    loss = -w * a * logp * m.to(logp.dtype)
    if params.objective == "opmd":
        loss = loss + params.tau * (logp - b) ** 2
    if params.objective == "asymre":
        loss = loss - params.tau * logp
    return loss


params_strategy = st.one_of(
    st.builds(
        ObjectiveParams,
        objective=st.just("grpo_clip"),
        eps_low=st.sampled_from([0.1, 0.2, 0.3]),
        eps_high=st.sampled_from([0.2, 0.28]),
        dual_clip=st.sampled_from([None, 2.0, 3.0]),
    ),
    st.builds(ObjectiveParams, objective=st.just("gpg")),
    st.builds(  # the REC family; tau only where it is used
        lambda obj, w, c, tau: ObjectiveParams(
            objective=obj, rec_weight=w, rec_clip=c, tau=0.0 if obj == "rec" else tau
        ),
        st.sampled_from(["rec", "opmd", "asymre"]),
        st.sampled_from(["none", "is"]),
        st.sampled_from(["none", "one_side", "two_side", "ring"]),
        st.sampled_from([0.0, 0.05, 0.3]),
    ),
)

token_batches = st.integers(1, 10).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-3.0, -0.01), min_size=n, max_size=n),  # logp
        st.lists(st.floats(-1.6, 1.6), min_size=n, max_size=n),  # log rho = logp - behavior: rho in [0.2, 5]
        st.lists(st.sampled_from([-2.0, -0.5, 0.0, 0.7, 1.5]), min_size=n, max_size=n),  # advantages
        st.lists(st.booleans(), min_size=n, max_size=n),  # loss mask
    )
)


def tensors(batch):
    logp, log_rho, adv, mask = batch
    logp_t = torch.tensor(logp, dtype=F64, requires_grad=True)
    behavior = logp_t.detach() - torch.tensor(log_rho, dtype=F64)
    return logp_t, behavior, torch.tensor(adv, dtype=F64), torch.tensor(mask)


@settings(max_examples=150, deadline=None)
@given(params=params_strategy, batch=token_batches)
def test_gradient_matches_written_formula(params, batch):
    logp, behavior, adv, mask = tensors(batch)
    ours = aggregate(token_loss(logp, behavior, adv, mask, params)[0], mask, params)
    (grad,) = torch.autograd.grad(ours, logp)
    logp2 = logp.detach().clone().requires_grad_(True)
    written = written_loss(params, logp2, behavior, adv)
    ref = torch.where(mask, written, 0).sum() / mask.sum().clamp_min(1)
    (grad_ref,) = torch.autograd.grad(ref, logp2)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
    assert (grad[~mask] == 0).all()


@settings(max_examples=100, deadline=None)
@given(batch=token_batches, eps_low=st.sampled_from([0.1, 0.2]), eps_high=st.sampled_from([0.2, 0.28]))
def test_clip_zeroes_gradient_exactly_on_the_correct_side(batch, eps_low, eps_high):
    logp, behavior, adv, mask = tensors(batch)
    params = ObjectiveParams(eps_low=eps_low, eps_high=eps_high)
    loss, _ = token_loss(logp, behavior, adv, mask, params)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    rho = torch.exp(logp.detach() - behavior)
    clipped = ((adv > 0) & (rho > 1 + eps_high)) | ((adv < 0) & (rho < 1 - eps_low))
    assert (grad[clipped | ~mask] == 0).all()
    live = ~clipped & mask & (adv != 0)
    torch.testing.assert_close(grad[live], -adv[live] * rho[live], rtol=1e-12, atol=0)  # never zeroed


@settings(max_examples=100, deadline=None)
@given(batch=token_batches, eps_low=st.sampled_from([0.1, 0.2]), eps_high=st.sampled_from([0.2, 0.28]))
def test_rec_one_side_is_equals_grpo_clip_gradient(batch, eps_low, eps_high):
    logp, behavior, adv, mask = tensors(batch)
    grads = []
    for params in (
        ObjectiveParams(objective="grpo_clip", eps_low=eps_low, eps_high=eps_high),
        ObjectiveParams(objective="rec", rec_clip="one_side", rec_weight="is", eps_low=eps_low, eps_high=eps_high),
    ):
        loss, _ = token_loss(logp, behavior, adv, mask, params)
        grads.append(torch.autograd.grad(aggregate(loss, mask, params), logp)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-14, atol=0)


ON_POLICY_PARAMS = [
    ObjectiveParams(),
    ObjectiveParams(dual_clip=3.0),
    ObjectiveParams(objective="gpg"),
    ObjectiveParams(objective="opmd", tau=0.5),  # the regulariser's gradient vanishes at logp = behavior
] + [
    ObjectiveParams(objective="rec", rec_weight=w, rec_clip=c)
    for w in ("none", "is")
    for c in ("none", "one_side", "two_side", "ring")
]


@settings(max_examples=40, deadline=None)
@given(batch=token_batches, index=st.integers(0, len(ON_POLICY_PARAMS) - 1))
def test_on_policy_identity(batch, index):
    # v = 1: behavior == current policy (detached) -> rho = 1 -> grad = -A grad logp / #valid tokens
    params = ON_POLICY_PARAMS[index]
    logp, _, adv, mask = tensors(batch)
    loss, sums = token_loss(logp, logp.detach(), adv, mask, params)
    (grad,) = torch.autograd.grad(aggregate(loss, mask, params), logp)
    expected = torch.where(mask, -adv, 0) / mask.sum().clamp_min(1)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    assert sums["clip_low_count"].item() == 0 and sums["clip_high_count"].item() == 0
