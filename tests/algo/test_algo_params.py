"""ObjectiveParams / AdvantageParams validation and the objective registry."""

import dataclasses

import pytest

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams
from megatron_offgrpo.algo._registry import get_objective, objective_names, register_objective
from megatron_offgrpo.algo._aggregate import _AGGREGATORS
from megatron_offgrpo.algo._params import AGGREGATIONS


def test_defaults_are_valid_and_frozen():
    params = ObjectiveParams()
    assert params.objective == "grpo_clip" and params.kl_estimator == "k3" and params.aggregation == "token_mean"
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.eps_low = 0.3  # type: ignore[misc]
    assert AdvantageParams().form == "sqrt_var" and AdvantageParams().mask_zero_variance


def test_registry_names():
    assert set(objective_names()) == {"grpo_clip", "gpg", "rec", "opmd", "asymre", "cispo", "gspo"}
    assert set(_AGGREGATORS) == set(AGGREGATIONS)


def test_registry_miss_lists_valid_names():
    with pytest.raises(ValueError, match=r"objective='ppo'.*asymre, cispo, gpg, grpo_clip, gspo, opmd, rec"):
        get_objective("ppo")


def test_registry_rejects_duplicate_names():
    with pytest.raises(ValueError, match="already registered"):
        register_objective("gpg")(lambda *a: None)


def test_objective_params_reports_every_error_together():
    with pytest.raises(ValueError) as info:
        ObjectiveParams(
            objective="nope",
            eps_low=1.5,
            eps_high=-0.1,
            dual_clip=0.9,
            rec_weight="both",
            rec_clip="three_side",
            tau=-1.0,
            kl_estimator="k4",
            kl_beta=-0.1,
            tis_cap=0.0,
            tis_level="batch",
            aggregation="median",
        )
    text = str(info.value)
    for field in (
        "objective='nope'",
        "eps_low=1.5",
        "eps_high=-0.1",
        "dual_clip=0.9",
        "rec_weight='both'",
        "rec_clip='three_side'",
        "tau=-1.0",
        "kl_estimator='k4'",
        "kl_beta=-0.1",
        "tis_cap=0.0",
        "tis_level='batch'",
        "aggregation='median'",
    ):
        assert field in text, field
    # 12 bad fields + 2 cross-field rules (dual_clip and tau are set for an objective that does not use them)
    assert "14 error(s)" in text


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"objective": "gpg", "dual_clip": 3.0}, "only used by objective='grpo_clip'"),
        ({"objective": "rec", "tau": 0.1}, "only used by objective in ('opmd', 'asymre')"),
        ({"aggregation": "token_sum_norm"}, "aggregation_constant=None"),
        ({"aggregation_constant": -1.0}, "aggregation_constant=-1.0"),
        ({"rec_clip": "ring", "eps_low_outer": 0.1}, "eps_low_outer=0.1"),  # below eps_low = 0.2
        ({"rec_clip": "ring", "eps_high_outer": 0.1}, "eps_high_outer=0.1"),  # below eps_high = 0.2
        ({"objective": "gspo"}, "set aggregation='seq_mean_token_mean'"),
        ({"objective": "gspo", "aggregation": "seq_mean_token_mean", "seq_eps_low": 1.5}, "seq_eps_low=1.5"),
        ({"seq_eps_high": -0.1}, "seq_eps_high=-0.1"),
        ({"eps_low": float("nan")}, "eps_low=nan"),
        ({"tis_cap": True}, "tis_cap=True"),
    ],
)
def test_objective_params_cross_field_rules(kwargs, needle):
    with pytest.raises(ValueError, match="invalid ObjectiveParams") as info:
        ObjectiveParams(**kwargs)
    assert needle in str(info.value)


def test_valid_non_default_combinations():
    ObjectiveParams(objective="grpo_clip", dual_clip=3.0, kl_beta=0.01, tis_cap=2.0, tis_level="sequence")
    ObjectiveParams(objective="rec", rec_weight="is", rec_clip="ring", eps_low_outer=0.6, eps_high_outer=2.0)
    ObjectiveParams(objective="opmd", tau=0.1, aggregation="token_sum_norm", aggregation_constant=512)
    ObjectiveParams(objective="asymre", tau=0.1, aggregation="seq_mean_token_mean")


def test_advantage_params_reports_every_error_together():
    with pytest.raises(ValueError) as info:
        AdvantageParams(form="zscore", eps=-1.0, leave_one_out="yes", red_drop=1)  # type: ignore[arg-type]
    text = str(info.value)
    assert "4 error(s)" in text
    for field in ("form='zscore'", "eps=-1.0", "leave_one_out='yes'", "red_drop=1"):
        assert field in text, field
