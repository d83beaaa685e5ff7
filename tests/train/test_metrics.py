"""MetricsLog: every scalar reaches metrics.jsonl and TensorBoard, whatever type computed it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_offgrpo.runlog._metrics import MetricsLog, plain_scalar, read_metrics
from megatron_offgrpo.runlog._trackers import TensorBoardTracker


def test_plain_scalar_unwraps_tensors_and_numpy_scalars():
    assert plain_scalar(torch.tensor(0.25)) == 0.25 and type(plain_scalar(torch.tensor(0.25))) is float
    assert plain_scalar(torch.tensor(7)) == 7 and type(plain_scalar(torch.tensor(7))) is int
    assert type(plain_scalar(np.float32(1.5))) is float and type(plain_scalar(np.int64(3))) is int
    assert plain_scalar(np.bool_(True)) is True
    assert plain_scalar(2.0) == 2.0 and plain_scalar("x") == "x"
    vector = torch.ones(2)
    assert plain_scalar(vector) is vector  # not a scalar: left for the caller to notice


def test_tensor_and_numpy_metrics_reach_jsonl_and_tensorboard(tmp_path, capsys):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    log = MetricsLog(tmp_path, total_steps=2, trackers=[TensorBoardTracker(tmp_path / "tensorboard")])
    values = {"loss": torch.tensor(0.5), "reward_mean": np.float64(0.75), "tokens": np.int64(96), "plain": 1.0,
              "policy_version": torch.tensor(3)}
    log.log(0, values)
    log.close()
    (record,) = read_metrics(tmp_path)
    assert {k: record[k] for k in values} == {"loss": 0.5, "reward_mean": 0.75, "tokens": 96, "plain": 1.0,
                                               "policy_version": 3}
    assert "reward 0.750" in capsys.readouterr().err  # the progress line formats the converted values
    events = event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(values) | {"wall_s"}  # before: the tensors and np.int64 were dropped
    assert events.Scalars("loss")[0].value == 0.5 and events.Scalars("tokens")[0].value == 96


def test_response_length_distribution_by_hand():
    from megatron_offgrpo.sampler._rollout_side import length_metrics

    # 10 lengths 1..10: mean 5.5; nearest rank: p50 = the 5th (ceil(0.5 x 10)), p90 = the 9th
    assert length_metrics([7, 1, 10, 2, 9, 3, 8, 4, 6, 5]) == {"response_len": 5.5, "response_len_min": 1,
                                                               "response_len_p50": 5, "response_len_p90": 9,
                                                               "response_len_max": 10}
    # 3 lengths: p50 = the 2nd (ceil(1.5)), p90 = the 3rd (ceil(2.7))
    assert length_metrics([4, 2, 9]) == {"response_len": 5.0, "response_len_min": 2, "response_len_p50": 4,
                                         "response_len_p90": 9, "response_len_max": 9}
