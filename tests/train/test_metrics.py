"""MetricsLog: every scalar reaches metrics.jsonl and TensorBoard, whatever type computed it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_offgrpo.train._metrics import MetricsLog, plain_scalar, read_metrics
from megatron_offgrpo.train._trackers import TensorBoardTracker


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
