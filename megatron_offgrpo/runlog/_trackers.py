"""Experiment trackers: where a run's metrics, config and sample completions go besides ``RUN/metrics.jsonl``.

One class per backend behind the ``Tracker`` protocol; ``MetricsLog`` (``runlog._metrics``) writes the JSONL and fans
every record out to them. They take plain numbers (``MetricsLog`` converts tensors and bools), the config as a nested
dict, and ``SampleRow``s. A backend's package is imported only when its tracker is
built; ``missing_trackers`` tells the preflight which named ones cannot be.

Offline use: ``WANDB_MODE=offline`` keeps wandb's run under ``RUN/wandb/`` (``wandb sync`` uploads it later); mlflow
logs to ``MLFLOW_TRACKING_URI`` when set, else to a file store in ``RUN/mlruns`` (``mlflow ui --backend-store-uri
RUN/mlruns``). A resumed run (``train.resume``) continues the wandb and mlflow runs it started (their ids are kept in
``RUN/trackers.json``), and TensorBoard hides the earlier process's events of the steps done again.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import yaml

logger = logging.getLogger(__name__)

TRACKING_EXTRA = "pip install 'megatron-offgrpo[tracking]'"
BACKENDS = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", TRACKING_EXTRA),
            "mlflow": ("mlflow", TRACKING_EXTRA)}
"""``train.loggers`` name -> (the package it needs, how to install it)."""


@dataclasses.dataclass(frozen=True)
class SampleRow:
    """One sampled completion as the trackers' tables show it (``train.samples_every``), decoded."""

    step: int
    prompt_id: str
    prompt: str
    response: str
    reward: float
    policy_version: int
    finish_reason: str | None
    length: int  # response tokens


SAMPLE_COLUMNS = tuple(field.name for field in dataclasses.fields(SampleRow))
IDS_FILE = "trackers.json"
"""``RUN/trackers.json``: the wandb and mlflow run ids, so that a resumed run continues them."""


class Tracker(Protocol):
    """One experiment-tracking backend (global rank 0 only)."""

    def log_hparams(self, config: dict[str, Any]) -> None:
        """The run's config (``Config.to_dict()``: nested sections)."""

    def log_metrics(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        """One step's metrics (Python numbers), and value distributions (e.g. response lengths)."""

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        """A table of sample completions."""

    def resume_at(self, step: int) -> None:
        """The run continues at ``step``: what an earlier process logged at ``step`` and after is done again."""

    def close(self) -> None:
        """Flush and finish."""


def missing_trackers(names: list[str]) -> list[str]:
    """One line per tracker of ``names`` whose package is not installed, naming how to install it."""
    return [f"train.loggers: {name} is not installed ({BACKENDS[name][1]}), or leave it out of train.loggers"
            for name in names if name in BACKENDS and importlib.util.find_spec(BACKENDS[name][0]) is None]


def make_trackers(names: list[str], run_dir: Path, project: str, run_name: str | None, resume: bool,
                  optional: tuple[str, ...] = ()) -> list[Tracker]:
    """The trackers of ``names`` (``train.loggers``), logging into ``run_dir``.

    Args:
        project: the wandb project / mlflow experiment. run_name: None: ``run_dir``'s name.
        resume: continue the wandb / mlflow runs recorded in ``RUN/trackers.json`` (new ones when there are none).
        optional: names skipped with an INFO line when their package is missing (the default list's tensorboard);
            any other missing one raises.

    Raises:
        ImportError: a named tracker's package is missing (the preflight reports it before a run starts).
    """
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if resume and ids_path.is_file() else {}
    run_name = run_name or run_dir.resolve().name
    trackers: list[Tracker] = []
    for name in names:
        if missing := missing_trackers([name]):
            if name in optional:
                logger.info("%s not installed: metrics go to %s only", name, run_dir / "metrics.jsonl")
                continue
            raise ImportError(missing[0])
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, project, run_name, ids.get("wandb")))
            ids["wandb"] = trackers[-1].run_id
        elif name == "mlflow":
            trackers.append(MlflowTracker(run_dir, project, run_name, ids.get("mlflow")))
            ids["mlflow"] = trackers[-1].run_id
    if ids:
        ids_path.write_text(json.dumps(ids, indent=1))
    return trackers


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"rollout": {"group_size": 8}}`` -> ``{"rollout.group_size": 8}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def markdown_table(rows: list[SampleRow]) -> str:
    """``rows`` as a markdown table (TensorBoard's text plugin renders it); newlines and pipes escaped."""
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "\\n")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(value) for value in dataclasses.astuple(row)) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoardTracker:
    """``RUN/tensorboard``: scalars, histograms, the config (as YAML text and in the HPARAMS tab), samples as text."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._dir, self._writer_class = log_dir, SummaryWriter
        self._writer = SummaryWriter(str(log_dir))

    def log_hparams(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        text = yaml.safe_dump(config, sort_keys=False)
        self._writer.add_text("config", "    " + text.replace("\n", "\n    "))  # indented: a code block
        values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flatten(config).items()}
        for summary in hparams(values, {}):  # the HPARAMS tab, in this run's directory (add_hparams makes a sub-run)
            self._writer.file_writer.add_summary(summary)

    def log_metrics(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        for key, values in histograms.items():
            if values:
                self._writer.add_histogram(key, np.asarray(values, dtype=float), step)

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        self._writer.add_text("samples", markdown_table(rows), step)

    def resume_at(self, step: int) -> None:
        self._writer.close()
        self._writer = self._writer_class(str(self._dir), purge_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A wandb run under ``RUN/wandb`` (online, or offline with ``WANDB_MODE=offline``); wandb's own console output
    is off (the quiet console), its x-axis is our ``step`` metric (a resumed run logs its re-done steps again)."""

    def __init__(self, run_dir: Path, project: str, run_name: str, run_id: str | None) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), id=run_id,
                              resume="allow" if run_id else None, settings=wandb.Settings(silent=True, console="off"))
        self.run_id = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        where = (f"offline in {self.run.dir.removesuffix('/files')} (upload: wandb sync)"
                 if self.run.offline else self.run.url)
        logger.info("wandb run %s: %s", run_name, where)

    def log_hparams(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        hists = {k: self._wandb.Histogram(v) for k, v in histograms.items() if v}
        self.run.log({**scalars, **hists, "step": step})

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=[list(dataclasses.astuple(r)) for r in rows])
        self.run.log({"samples": table, "step": step})

    def resume_at(self, step: int) -> None:
        pass  # the run continues (its id is in RUN/trackers.json); re-done steps are logged again at their step

    def close(self) -> None:
        self.run.finish()
        self._wandb.teardown()  # waits for wandb's service to write the run out (finish alone may return before)


class MlflowTracker:
    """An mlflow run (experiment ``train.project``) at ``MLFLOW_TRACKING_URI``, else in a file store ``RUN/mlruns``.

    Metric names keep the characters mlflow allows (``eval_pass@4`` is logged as ``eval_pass_at_4``); parameters are
    the flattened config (``rollout.group_size``), values cut at mlflow's length limit."""

    def __init__(self, run_dir: Path, project: str, run_name: str, run_id: str | None) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a store of this run's own; mlflow 3 asks for this opt-in to use a file store
            if not os.environ.get("MLFLOW_ALLOW_FILE_STORE"):
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
            uri = (run_dir / "mlruns").resolve().as_uri()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)
        if run_id is None:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        logger.info("mlflow run %s: %s (run id %s)", run_name, uri, run_id)

    @staticmethod
    def metric_name(key: str) -> str:
        """``key`` with the characters mlflow refuses replaced (``@`` -> ``_at_``, others -> ``_``)."""
        return re.sub(r"[^\w\-. /]", "_", key.replace("@", "_at_"))

    def log_hparams(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        logged = self.client.get_run(self.run_id).data.params  # a resumed run: its parameters are set
        params = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in flatten(config).items() if k not in logged]
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + MAX_PARAMS_TAGS_PER_BATCH])

    def log_metrics(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        now = int(time.time() * 1000)
        metrics = [Metric(self.metric_name(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_BATCH])

    def log_samples(self, step: int, rows: list[SampleRow]) -> None:
        data = {c: [getattr(r, c) for r in rows] for c in SAMPLE_COLUMNS}
        self.client.log_table(self.run_id, data, f"samples/step_{step:08d}.json")

    def resume_at(self, step: int) -> None:
        pass  # the run continues (its id is in RUN/trackers.json); re-done steps get a second value at their step

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
