"""token_loss: KL term, TIS factor, masking safety, metric sums, bad inputs."""

import math

import pytest
import torch

from megatron_offgrpo.algo import ObjectiveParams
from megatron_offgrpo.algo._token_loss import finalize_metrics, token_loss

F64 = torch.float64


def f64(*values, grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


@pytest.mark.parametrize(
    "estimator, value, grad",
    [
        # logp = -1, ref = -2, d = ref - logp = -1
        ("k1", 1.0, 1.0),  # logp - ref = 1; d/dlogp = 1
        ("k2", 0.5, 1.0),  # 0.5 d^2 = 0.5; d/dlogp = -d = 1
        ("k3", math.exp(-1.0), 1.0 - math.exp(-1.0)),  # e^d - d - 1 = e^-1; d/dlogp = 1 - e^d
    ],
)
def test_kl_estimators_by_hand(estimator, value, grad):
    # gpg with A = 0 has zero policy loss, so the token loss is beta * KL with beta = 0.5
    params = ObjectiveParams(objective="gpg", kl_estimator=estimator, kl_beta=0.5)
    logp = f64(-1.0, grad=True)
    loss, sums = token_loss(logp, f64(-1.0), f64(0.0), torch.tensor([True]), params, ref_logp=f64(-2.0))
    loss.sum().backward()
    torch.testing.assert_close(loss, f64(0.5 * value))
    torch.testing.assert_close(logp.grad, f64(0.5 * grad))
    torch.testing.assert_close(sums["kl_sum"], torch.tensor(value, dtype=F64))


def test_kl_measured_without_beta_does_not_change_the_loss():
    params = ObjectiveParams(objective="gpg")
    logp = f64(-1.0, -0.5)
    mask = torch.tensor([True, True])
    plain, sums_plain = token_loss(logp, logp, f64(1.0, 1.0), mask, params)
    with_ref, sums = token_loss(logp, logp, f64(1.0, 1.0), mask, params, ref_logp=f64(-2.0, -0.5))
    assert torch.equal(plain, with_ref)
    assert sums_plain["kl_sum"].item() == 0.0
    torch.testing.assert_close(sums["kl_sum"], torch.tensor(math.exp(-1.0), dtype=F64))  # k3: e^-1 + 0


def test_k3_is_nonnegative_and_finite_for_huge_gaps():
    params = ObjectiveParams(objective="gpg", kl_beta=1.0)
    logp = f64(-200.0, 0.0, -1.0, grad=True)
    mask = torch.ones(3, dtype=torch.bool)
    loss, _ = token_loss(logp, logp.detach(), f64(0, 0, 0), mask, params, ref_logp=f64(0.0, -200.0, -1.0))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and (loss >= 0).all() and torch.isfinite(logp.grad).all()
    assert loss[2].item() == 0.0  # equal policies: KL 0


def test_tis_weights_scale_the_policy_term_only():
    # grpo_clip on-policy: policy loss -A = -2; weight 0.5 -> -1; plus beta * k1 = 0.1 * (-1 - -1.5) = 0.05
    params = ObjectiveParams(kl_estimator="k1", kl_beta=0.1)
    logp = f64(-1.0, grad=True)
    mask = torch.tensor([True])
    loss, _ = token_loss(logp, f64(-1.0), f64(2.0), mask, params, ref_logp=f64(-1.5), tis_weights=f64(0.5, grad=True))
    loss.sum().backward()
    torch.testing.assert_close(loss, f64(-1.0 + 0.05))
    torch.testing.assert_close(logp.grad, f64(0.5 * -2.0 + 0.1))  # w * (-A rho) + beta


def test_masked_positions_give_exact_zero_loss_and_grad_even_with_garbage():
    params = ObjectiveParams(kl_beta=0.1, dual_clip=3.0)
    logp = f64(-0.5, -math.inf, math.nan, 1e30, grad=True)
    behavior = f64(-0.4, math.nan, -math.inf, -1e30)
    adv = f64(1.0, math.nan, 1.0, math.inf)
    mask = torch.tensor([True, False, False, False])
    ref_logp = f64(-0.5, math.nan, 0.0, math.inf)
    tis = f64(1.0, math.nan, math.inf, 1.0)
    loss, sums = token_loss(logp, behavior, adv, mask, params, ref_logp=ref_logp, tis_weights=tis)
    loss.sum().backward()
    assert loss[1:].tolist() == [0.0, 0.0, 0.0] and torch.isfinite(loss[0])
    assert logp.grad[1:].tolist() == [0.0, 0.0, 0.0] and torch.isfinite(logp.grad[0])
    assert sums["token_count"].item() == 1 and all(torch.isfinite(v) for v in sums.values())


def test_extreme_valid_log_ratio_stays_finite():
    # log rho = 1000: clamped to 20 before exp; A > 0 is clipped (grad 0), A < 0 is finite
    logp = f64(0.0, 0.0, grad=True)
    mask = torch.tensor([True, True])
    loss, _ = token_loss(logp, f64(-1000.0, -1000.0), f64(1.0, -1.0), mask, ObjectiveParams())
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
    assert logp.grad[0].item() == 0.0


def test_float32_inputs_keep_float32_and_metrics_are_detached():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    mask = torch.tensor([True, True])
    loss, sums = token_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, ObjectiveParams())
    assert loss.dtype == torch.float32 and loss.requires_grad
    assert all(not v.requires_grad and v.dim() == 0 for v in sums.values())


def test_finalize_metrics_divides_and_never_nans():
    token_sums = {"token_count": 4.0, "clip_low_count": 1.0, "clip_high_count": 2.0, "dual_clip_count": 0.0}
    token_sums |= {"kl_sum": 2.0, "entropy_sum": 6.0}
    out = finalize_metrics({k: torch.tensor(v) for k, v in token_sums.items()})
    # fractions and means divide by token_count = 4
    assert out["clip_low_fraction"].item() == 0.25 and out["clip_high_fraction"].item() == 0.5
    assert out["clip_fraction"].item() == 0.75 and out["kl_mean"].item() == 0.5 and out["entropy_mean"].item() == 1.5
    tis_sums = {"tis_unit_count": 0.0, "tis_raw_sum": 0.0, "tis_truncated_count": 0.0, "tis_weight_sum": 0.0}
    tis_sums |= {"tis_raw_max": -math.inf, "tis_raw_min": math.inf}  # the all-reduce identities
    nothing_counted = {k: 0.0 for k in token_sums} | tis_sums
    empty = finalize_metrics({k: torch.tensor(v) for k, v in nothing_counted.items()})
    assert len(empty) == 11 and all(v.item() == 0.0 for v in empty.values())


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"logp": torch.zeros(3)}, "logp has 3 entries but the token axis"),
        ({"behavior_logp": torch.zeros(2, 1)}, "behavior_logp has shape"),
        ({"advantages": torch.zeros(2, dtype=torch.long)}, "advantages has dtype torch.int64"),
        ({"loss_mask": torch.ones(2)}, "loss_mask has dtype torch.float32; it must be torch.bool"),
        ({"loss_mask": [True, True]}, "loss_mask must be a torch.Tensor"),
        ({"ref_logp": torch.zeros(4)}, "ref_logp has 4 entries"),
        ({"tis_weights": torch.zeros(1)}, "tis_weights has 1 entries"),
    ],
)
def test_bad_inputs(change, needle):
    args = {"logp": torch.zeros(2), "behavior_logp": torch.zeros(2), "advantages": torch.zeros(2)}
    args["loss_mask"] = torch.ones(2, dtype=torch.bool)
    args.update(change)
    with pytest.raises(ValueError, match=needle):
        token_loss(params=ObjectiveParams(), **args)


def test_kl_beta_without_ref_logp_raises():
    zero, mask = torch.zeros(1), torch.ones(1, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"kl_beta=0.1 needs ref_logp"):
        token_loss(zero, zero, zero, mask, ObjectiveParams(kl_beta=0.1))
