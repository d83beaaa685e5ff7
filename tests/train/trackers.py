"""Read a run's trackers back from disk, offline: TensorBoard's event files, wandb's offline run file, mlflow's file
store. Each reader returns ``{metric: {step: value}}`` (wandb and mlflow: also the config and the sample tables)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

OFFLINE_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
               "MLFLOW_ALLOW_FILE_STORE": "true"}
"""What every tracker test runs under: nothing reaches a network (and MLFLOW_TRACKING_URI is removed)."""


def offline_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base, **OFFLINE_ENV)
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def tensorboard_run(run_dir: Path):
    """The loaded ``EventAccumulator`` of ``RUN/tensorboard`` (histograms and text kept in full)."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0,
                                                                                             "histograms": 0})
    events.Reload()
    return events


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    events = tensorboard_run(run_dir)
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def wandb_records(run_dir: Path):
    """The protobuf records of the wandb run under ``RUN/wandb`` (its ``run-ID.wandb`` file: LevelDB's log format,
    32 KiB blocks of records with a 7-byte header, after wandb's own 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("*run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_run(run_dir: Path) -> tuple[dict[str, dict[int, float]], dict, dict[int, dict]]:
    """(metrics by our ``step``, the config, the sample tables' JSON by step) of the offline wandb run."""
    metrics: dict[str, dict[int, float]] = {}
    config: dict = {}
    tables: dict[int, dict] = {}
    files = next((run_dir / "wandb").glob("*run-*")) / "files"
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items["step"]
            for key, value in items.items():
                if not key.startswith("_") and "/" not in key:
                    metrics.setdefault(key, {})[step] = value
            if "samples/path" in items:
                tables[step] = json.loads((files / items["samples/path"]).read_text())
            if "response_len_hist/_type" in items:
                metrics.setdefault("response_len_hist", {})[step] = items["response_len_hist/_type"]
        elif kind in ("run", "config"):
            update = record.run.config.update if kind == "run" else record.config.update
            for item in update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return metrics, config, tables


def mlflow_run(run_dir: Path):
    """(the MlflowClient on ``RUN/mlruns``, the run recorded in ``RUN/trackers.json``)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    return client, client.get_run(run_id)


def mlflow_metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    client, run = mlflow_run(run_dir)
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
