"""Truncated importance sampling: token and sequence level, statistics, bad inputs."""

import math

import pytest
import torch

from megatron_offgrpo.algo._tis import truncated_is_weights

F64 = torch.float64
E = math.e


def f64(*values):
    return torch.tensor(values, dtype=F64)


# trainer_old = 0 everywhere, fleet = [-1, 0, 0.5, 7] -> log-ratio [1, 0, -0.5, -7]; token 3 is masked out.
OLD, FLEET = f64(0.0, 0.0, 0.0, 0.0), f64(-1.0, 0.0, 0.5, 7.0)
MASK = torch.tensor([True, True, True, False])


def test_token_level_by_hand():
    weights, stats = truncated_is_weights(OLD, FLEET, MASK, cap=2.0)
    # raw = [e, 1, e^-0.5] -> min(raw, 2) = [2, 1, e^-0.5]; masked token -> 0
    torch.testing.assert_close(weights, f64(2.0, 1.0, math.exp(-0.5), 0.0))
    assert stats["tis_unit_count"].item() == 3 and stats["tis_truncated_count"].item() == 1
    torch.testing.assert_close(stats["tis_raw_sum"], torch.tensor(E + 1 + math.exp(-0.5), dtype=F64))
    torch.testing.assert_close(stats["tis_raw_max"], torch.tensor(E, dtype=F64))
    torch.testing.assert_close(stats["tis_raw_min"], torch.tensor(math.exp(-0.5), dtype=F64))
    torch.testing.assert_close(stats["tis_weight_sum"], torch.tensor(3 + math.exp(-0.5), dtype=F64))


def test_sequence_level_by_hand():
    # sequences [0, 0, 1, 1]; masked token 3 does not enter the sum.
    # seq 0: exp(1 + 0) = e -> min(e, 2) = 2; seq 1: exp(-0.5) (not truncated)
    weights, stats = truncated_is_weights(OLD, FLEET, MASK, 2.0, "sequence", seq_ids=torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(weights, f64(2.0, 2.0, math.exp(-0.5), 0.0))
    assert stats["tis_unit_count"].item() == 2 and stats["tis_truncated_count"].item() == 1
    torch.testing.assert_close(stats["tis_raw_sum"], torch.tensor(E + math.exp(-0.5), dtype=F64))
    same, _ = truncated_is_weights(OLD, FLEET, MASK, 2.0, "sequence", cu_seqlens=torch.tensor([0, 2, 4]))
    assert torch.equal(weights, same)


def test_no_cap_reports_raw_ratios_untruncated():
    weights, stats = truncated_is_weights(OLD, FLEET, MASK, cap=None)
    torch.testing.assert_close(weights, f64(E, 1.0, math.exp(-0.5), 0.0))
    assert stats["tis_truncated_count"].item() == 0


def test_weights_are_detached_and_overflow_truncates():
    old = torch.tensor([0.0, 0.0], requires_grad=True)
    weights, stats = truncated_is_weights(old, torch.tensor([-1000.0, 0.0]), torch.tensor([True, True]), cap=2.0)
    assert not weights.requires_grad and weights.tolist() == [2.0, 1.0]
    assert stats["tis_raw_max"].item() == math.inf  # raw ratio overflowed: reported honestly, weight truncated


def test_all_masked_gives_identity_extremes():
    _, stats = truncated_is_weights(OLD, FLEET, torch.zeros(4, dtype=torch.bool), cap=2.0)
    assert stats["tis_unit_count"].item() == 0
    assert stats["tis_raw_max"].item() == -math.inf and stats["tis_raw_min"].item() == math.inf


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"cap": 0.0}, "cap=0.0 must be a finite number > 0"),
        ({"cap": math.inf}, "cap=inf"),
        ({"cap": 2.0, "level": "batch"}, "level='batch'"),
        ({"cap": 2.0, "level": "sequence"}, "pass exactly one of seq_ids or cu_seqlens"),
        ({"cap": 2.0, "level": "sequence", "cu_seqlens": torch.tensor([0, 2, 3])}, "end at N=4"),
        ({"cap": 2.0, "fleet_logp": torch.zeros(3, dtype=F64)}, "fleet_logp has 3 entries"),
    ],
)
def test_bad_inputs(kwargs, needle):
    args = {"trainer_old_logp": OLD, "fleet_logp": FLEET, "loss_mask": MASK} | kwargs
    with pytest.raises(ValueError, match=needle):
        truncated_is_weights(**args)
