"""Trackers (train.loggers): every metric of a record reaches TensorBoard, wandb and mlflow as a number, with the run's
config and the sample tables, all offline (wandb offline mode, mlflow's file store); a tracker named but not installed
stops the command before it starts, with one line naming the pip extra."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import subprocess
import sys
import time
import typing

import numpy as np
import pytest
import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.data import Sample
from megatron_offgrpo.runlog import _trackers
from megatron_offgrpo.runlog._metrics import MetricsLog, completion_rows, read_metrics
from megatron_offgrpo.preflight._checks import tracker_errors
from megatron_offgrpo.runlog._trackers import BACKENDS, SAMPLE_COLUMNS, make_trackers
from tests.helpers import REPO
from tests.train.trackers import (
    OFFLINE_ENV,
    mlflow_metrics,
    mlflow_run,
    tensorboard_run,
    tensorboard_scalars,
    wandb_run,
)

RECORD = {  # what the loop hands MetricsLog: tensors, numpy scalars, ints, bools, floats
    "loss": torch.tensor(0.5), "masked_group_fraction": torch.tensor(0.25, dtype=torch.float64),
    "reward_mean": np.float64(0.75), "tokens": np.int64(96), "policy_version": torch.tensor(3), "skipped": False,
    "flag": np.bool_(True), "response_len_p90": 7, "lr": 1e-3, "eval_pass@2": 0.5,
}
NUMBERS = {"loss": 0.5, "masked_group_fraction": 0.25, "reward_mean": 0.75, "tokens": 96, "policy_version": 3,
           "skipped": 0, "flag": 1, "response_len_p90": 7, "lr": 1e-3, "eval_pass@2": 0.5}


class Tokenizer:
    """Decodes ids as their numbers (what a row's text is made of is not the point)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def samples(groups: int = 3, group_size: int = 2) -> list[Sample]:
    return [Sample(f"p{b}", b, [1, 2, b], [5] * (g + 1), [0.0] * (g + 1), 0, "length" if g else "stop",
                   reward=float(g)) for b in range(groups) for g in range(group_size)]


@pytest.fixture
def offline(monkeypatch):
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _installed(name: str):
    return pytest.mark.skipif(importlib.util.find_spec(BACKENDS[name][0]) is None,
                              reason=f"{name} is not installed ({BACKENDS[name][1]})")


def _log_two_steps(run_dir, names, caplog):
    trackers = make_trackers(names, run_dir, "offgrpo-test", None, resume=False)
    log = MetricsLog(run_dir, 2, trackers, samples_every=1, tokenizer=Tokenizer(),
                     hparams=load_config(REPO / "configs" / "tiny-cpu.yaml").to_dict())
    with caplog.at_level(logging.WARNING):
        log.log(0, {**RECORD, "note": "text"}, samples())
        log.log(1, {**RECORD, "note": "text"}, samples())
    log.close()
    warned = [r.getMessage() for r in caplog.records if "note" in r.getMessage()]
    assert len(warned) == 1 and "not a number" in warned[0]  # once, not every step
    return read_metrics(run_dir)


def _check_numbers(got: dict[str, dict[int, float]], records, rename=lambda k: k):
    for key, want in NUMBERS.items():
        assert got[rename(key)] == pytest.approx({0: want, 1: want}), key
    assert set(map(rename, [k for k in records[0] if k not in ("step", "note")])) <= set(got)  # wall_s too
    assert "note" not in got


@_installed("tensorboard")
def test_every_metric_reaches_tensorboard(tmp_path, caplog):
    records = _log_two_steps(tmp_path, ["tensorboard"], caplog)
    events = tensorboard_run(tmp_path)
    _check_numbers({tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}, records)
    tensors = events.Tags()["tensors"]
    assert "config/text_summary" in tensors and "samples/text_summary" in tensors
    table = events.Tensors("samples/text_summary")[0].tensor_proto.string_val[0].decode()
    assert table.startswith("| step | prompt_id | prompt |") and "| 1 2 0 | 5 5 |" in table
    assert [h.step for h in events.Histograms("response_len_hist")] == [0, 1]
    assert events.Histograms("response_len_hist")[0].histogram_value.num == 6


@_installed("wandb")
def test_every_metric_reaches_wandb_offline(tmp_path, offline, caplog):
    records = _log_two_steps(tmp_path, ["wandb"], caplog)
    metrics, config, tables = wandb_run(tmp_path)
    _check_numbers(metrics, records)
    assert config["rollout"]["group_size"] == 8 and config["train"]["loggers"] == ["tensorboard"]
    assert tables[0]["columns"] == list(SAMPLE_COLUMNS) and len(tables[0]["data"]) == 4  # 2 groups x G=2
    assert metrics["response_len_hist"] == {0: "histogram", 1: "histogram"}


@_installed("mlflow")
def test_every_metric_reaches_mlflow_file_store(tmp_path, offline, caplog):
    records = _log_two_steps(tmp_path, ["mlflow"], caplog)
    _check_numbers(mlflow_metrics(tmp_path), records, _trackers.MlflowTracker.metric_name)
    client, run = mlflow_run(tmp_path)
    assert run.data.params["rollout.group_size"] == "8" and run.info.run_name == tmp_path.name
    assert run.info.status == "FINISHED"
    table = json.loads((tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts" / "samples"
                        / "step_00000001.json").read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and len(table["data"]) == 4


def test_mlflow_metric_names_keep_allowed_characters():
    assert _trackers.MlflowTracker.metric_name("eval_pass@4") == "eval_pass_at_4"
    assert _trackers.MlflowTracker.metric_name("a.b/c-d e_f") == "a.b/c-d e_f"
    assert _trackers.MlflowTracker.metric_name("x%y") == "x_y"


def test_samples_jsonl_rows_and_resume_drops_the_redone_steps(tmp_path):
    log = MetricsLog(tmp_path, 4, samples_every=2, tokenizer=Tokenizer())
    for step in range(4):
        log.log(step, {"loss": 1.0}, samples())
    log.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [2] * 4  # steps 0 and 2; groups 0 and 1 of 3
    assert rows[1] == {"step": 0, "prompt_id": "p0", "prompt": "1 2 0", "response": "5 5", "reward": 1.0,
                       "policy_version": 0, "finish_reason": "length", "length": 2}
    log = MetricsLog(tmp_path, 4, samples_every=2, tokenizer=Tokenizer())
    log.resume_at(2)
    log.close()
    assert {json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()} == {0}
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]


def test_completion_rows_are_the_first_two_groups():
    rows = completion_rows(samples(groups=3, group_size=3), Tokenizer(), step=5)
    assert [(r.prompt_id, r.length) for r in rows] == [("p0", 1), ("p0", 2), ("p0", 3), ("p1", 1), ("p1", 2),
                                                             ("p1", 3)]


def test_a_failing_tracker_is_named_and_dropped(tmp_path, caplog):
    class Broken:
        def log_metrics(self, step, scalars, histograms):
            raise ConnectionError("server gone")

        def close(self):
            raise AssertionError("never called: dropped")

    log = MetricsLog(tmp_path, 2, [Broken()])
    with caplog.at_level(logging.WARNING):
        log.log(0, {"loss": 1.0})
        log.log(1, {"loss": 1.0})
    log.close()
    assert [r.getMessage() for r in caplog.records].count(
        "Broken failed (ConnectionError: server gone): it gets nothing more; metrics.jsonl has every step") == 1
    assert len(read_metrics(tmp_path)) == 2


def test_the_logger_names_validate_against_the_backends():
    from megatron_offgrpo.config import Logger

    assert set(typing.get_args(Logger)) == set(BACKENDS)


def test_a_named_tracker_that_is_not_installed_is_an_error_naming_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "tensorboard")
                        else real(name, *a))
    tiny = REPO / "configs" / "tiny-cpu.yaml"
    assert tracker_errors(load_config(tiny)) == []  # the default list: tensorboard is skipped, with an INFO line
    errors = tracker_errors(load_config(tiny, ["train.loggers=[tensorboard,wandb]"]))
    assert errors == ["train.loggers: tensorboard is not installed (pip install tensorboard), or leave it out of "
                      "train.loggers",
                      "train.loggers: wandb is not installed (pip install 'megatron-offgrpo[tracking]'), or leave it "
                      "out of train.loggers"]
    with pytest.raises(ImportError, match="megatron-offgrpo\\[tracking\\]"):
        make_trackers(["wandb"], REPO, "p", None, resume=False)


def test_nan_and_inf_metrics_still_reach_jsonl(tmp_path):
    log = MetricsLog(tmp_path, 1)
    log.log(0, {"loss": float("nan"), "grad_norm": torch.tensor(float("inf"))})
    log.close()
    (record,) = read_metrics(tmp_path)
    assert math.isnan(record["loss"]) and record["grad_norm"] == float("inf")


@pytest.mark.slow
@_installed("tensorboard")
@_installed("wandb")
@_installed("mlflow")
def test_a_real_run_gets_every_metric_config_and_sample_into_every_tracker(tmp_path, offline):
    """One real `offgrpo train` run (2 steps, evaluations with pass@k: metric names mlflow refuses) with all three
    trackers offline: every metrics.jsonl key reaches each of them, the config too, the completion tables of both
    steps land in samples.jsonl and each tracker, and the console stays quiet."""
    from tests.train.conftest import TINY, train_env
    from tests.train.trackers import offline_env

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_offgrpo.train", *TINY, "rollout.prompts_per_step=3", "rollout.group_size=2",
           "rollout.max_new_tokens=4", "train.steps=2", f"train.out_dir={out}", "train.samples_every=1",
           "train.loggers=[tensorboard,wandb,mlflow]", "train.eval_every=2", "train.eval_prompts=2",
           "train.eval_samples=2"]
    proc = subprocess.run(cmd, cwd=REPO, env=offline_env(train_env()), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    chatter = [line for line in proc.stderr.splitlines()
               if line.startswith("wandb:") or re.search(r" (DEBUG|INFO|WARNING) (wandb|mlflow)\b", line)]
    assert not chatter, chatter  # wandb's banner and mlflow's own lines stay off the quiet console
    assert "wandb run run: offline in" in proc.stderr and "mlflow run run: file://" in proc.stderr  # ours, once
    records = read_metrics(out)
    keys = set().union(*records) - {"step"}
    assert {"response_len_p50", "response_len_p90", "truncated_fraction", "eval_pass@2", "skipped"} <= keys
    assert not keys - set(tensorboard_scalars(out))
    wandb_metrics, wandb_config, wandb_tables = wandb_run(out)
    assert not keys - set(wandb_metrics)
    assert not {_trackers.MlflowTracker.metric_name(k) for k in keys} - set(mlflow_metrics(out))
    for step in (0, 1):  # the values agree too
        assert mlflow_metrics(out)["eval_start_pass_at_2" if step == 0 else "loss"][step] == pytest.approx(
            records[step]["eval_start_pass@2" if step == 0 else "loss"])
        assert wandb_metrics["reward_mean"][step] == pytest.approx(records[step]["reward_mean"])
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * 4 + [1] * 4 and set(rows[0]) == set(SAMPLE_COLUMNS)  # 2 groups x G=2
    assert all("What is" in r["prompt"] and isinstance(r["response"], str) and r["length"] <= 4 for r in rows)
    assert sorted(wandb_tables) == [0, 1] and wandb_tables[1]["columns"] == list(SAMPLE_COLUMNS)
    assert wandb_config["train"]["samples_every"] == 1
    client, run = mlflow_run(out)
    assert run.data.params["train.loggers"] == "['tensorboard', 'wandb', 'mlflow']"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "samples")} == {
        "samples/step_00000000.json", "samples/step_00000001.json"}
    events = tensorboard_run(out)
    assert [e.step for e in events.Tensors("samples/text_summary")] == [0, 1]
    assert "config/text_summary" in events.Tags()["tensors"]


@_installed("tensorboard")
@_installed("wandb")
@_installed("mlflow")
def test_a_resumed_run_continues_its_tracker_runs(tmp_path, offline):
    """Steps 0-2 logged, then a resume at step 1 logs steps 1-2 again: TensorBoard shows the re-done steps' new values
    only (purged), mlflow continues the same run (its last value per step is the new one), wandb the same run id."""
    names = ["tensorboard", "wandb", "mlflow"]
    log = MetricsLog(tmp_path, 3, make_trackers(names, tmp_path, "p", None, resume=False), hparams={"a": 1})
    for step in range(3):
        log.log(step, {"loss": float(step)})
    log.close()
    ids = json.loads((tmp_path / "trackers.json").read_text())
    # TensorBoard reads event files in name order: creation second, then a per-process writer counter compared as
    # text ("10" < "9" once other tests made writers). A real resume is another process, seconds later.
    time.sleep(1.1)
    log = MetricsLog(tmp_path, 3, make_trackers(names, tmp_path, "p", None, resume=True), hparams={"a": 1, "b": 2})
    log.resume_at(1)
    for step in (1, 2):
        log.log(step, {"loss": 10.0 + step})
    log.close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == ids
    assert tensorboard_scalars(tmp_path)["loss"] == {0: 0.0, 1: 11.0, 2: 12.0}
    assert mlflow_metrics(tmp_path)["loss"] == {0: 0.0, 1: 11.0, 2: 12.0}
    assert mlflow_run(tmp_path)[1].data.params == {"a": "1", "b": "2"}  # the new key added, the old one kept
    assert [p.name.rsplit("-", 1)[1] for p in (tmp_path / "wandb").glob("offline-run-*")] == [ids["wandb"]] * 2
