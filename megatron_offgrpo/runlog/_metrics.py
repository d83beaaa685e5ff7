"""Run metrics: one JSON line per step in ``RUN/metrics.jsonl`` (always), sample completions in ``RUN/samples.jsonl``
every ``train.samples_every`` steps, a console progress line, and the same records fanned out to the trackers of
``train.loggers`` (``runlog._trackers``: TensorBoard, wandb, mlflow)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from megatron_offgrpo.config import Config, TrainConfig
from megatron_offgrpo.data import Sample
from megatron_offgrpo.runlog._disk import writing
from megatron_offgrpo.runlog._checkpoints import merge_metrics, merge_samples, steps_text
from megatron_offgrpo.runlog._trackers import SampleRow, Tracker, make_trackers

logger = logging.getLogger(__name__)
SAMPLE_GROUPS = 2
"""Groups of a step whose completions ``train.samples_every`` records (the first ones: all their G samples)."""
SAMPLES_FILE = "samples.jsonl"


def plain_scalar(value: Any) -> Any:
    """A 0-d torch tensor or numpy scalar as the Python number it holds; anything else unchanged.

    Metrics arrive as whatever computed them (a loss tensor, a ``np.float64`` mean): TensorBoard takes Python numbers
    only, and JSON's ``default=float`` would turn an integer or bool scalar into a float.
    """
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()  # torch.Tensor (0-d) and np.generic both have ndim 0 and item()
    return value


def tracker_value(value: Any) -> int | float | None:
    """``value`` (after ``plain_scalar``) as the number a tracker takes: bools as 0/1; None when it is not a number."""
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, (int, float)) else None


def _is_number_list(value: Any) -> bool:
    """A per-item metric (``moe_tokens_per_expert``): kept whole in metrics.jsonl, not a tracker scalar."""
    return isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)


def completion_rows(samples: Sequence[Sample], tokenizer, step: int, groups: int = SAMPLE_GROUPS) -> list[SampleRow]:
    """The completions of the first ``groups`` groups as table rows, decoded."""
    def text(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return [SampleRow(step, s.prompt_id, text(s.prompt_ids), text(s.response_ids), float(s.reward), s.policy_version,
                      s.finish_reason, len(s.response_ids)) for s in samples if s.group_id < groups]


def grpo_progress(values: dict[str, Any]) -> str:
    """The middle of an RL step's progress line: reward (and a reward model's mean score), accuracy, loss, masking,
    clipping, version, times."""
    model = f"rm {values['reward_model_mean']:.3f} " if "reward_model_mean" in values else ""
    return (f"reward {values.get('reward_mean', float('nan')):.3f} {model}"
            f"acc {values.get('accuracy', float('nan')):.3f} "
            f"loss {values.get('loss', float('nan')):+.4f} masked {values.get('masked_group_fraction', 0):.2f} "
            f"clip {values.get('clip_fraction', 0):.3f} v{values.get('policy_version', 0)} "
            f"gen {values.get('time_generate_s', 0):.1f}s sync {values.get('time_sync_s', 0):.2f}s "
            f"train {values.get('time_train_s', 0):.1f}s {values.get('tokens_per_s', 0):.0f} tok/s")


class MetricsLog:
    """Writes ``RUN/metrics.jsonl`` and ``RUN/samples.jsonl`` and feeds the trackers; only rank 0 creates one."""

    def __init__(self, run_dir: Path, total_steps: int, trackers: Sequence[Tracker] = (), log_every: int = 1,
                 samples_every: int = 0, tokenizer=None, progress: Callable[[dict[str, Any]], str] = grpo_progress,
                 hparams: dict[str, Any] | None = None) -> None:
        """Args: run_dir: the run directory. total_steps: for the progress display. trackers: where every record
        also goes. log_every: the console line's interval. samples_every: completion tables every N steps (0: off;
        needs ``tokenizer`` to decode them). progress: the console line's middle, from a step's values. hparams: the
        run's config for the trackers, given with the first record (after a ``resume_at``, which may reopen them)."""
        self.path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / SAMPLES_FILE
        self._file = open(self.path, "a", buffering=1)
        self._trackers = list(trackers)
        self._total, self._log_every, self._progress = total_steps, log_every, progress
        self._samples_every, self._tokenizer = samples_every if tokenizer is not None else 0, tokenizer
        self._start = time.time()
        self._first, self._resumed_wall = 0, 0.0  # a resumed run: its first step, the wall-clock it had reached
        self._not_numbers: set[str] = set()  # metrics the trackers cannot take (warned once each)
        self._hparams = hparams
        self._tail: dict[str, list[dict[str, Any]]] = {"metrics": [], "samples": []}  # since the last checkpoint

    def checkpoint_tail(self) -> dict[str, list[dict[str, Any]]]:
        """Make every record and completion row logged so far durable (fsync), and hand over those logged since the
        previous call for the checkpoint about to be published to keep (``runlog._checkpoints``): its records are then
        on disk before it is, so a crash never leaves a checkpoint ahead of ``metrics.jsonl``."""
        self._file.flush()
        with writing(self.path):
            os.fsync(self._file.fileno())
            if self.samples_path.exists():
                fd = os.open(self.samples_path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        tail, self._tail = self._tail, {"metrics": [], "samples": []}
        return tail

    def resume_at(self, step: int, saved: dict[str, list[dict[str, Any]]] | None = None) -> None:
        """Continue a resumed run at ``step``: the records of later steps (logged after the checkpoint the run resumes
        from, before it stopped) are dropped, since the run logs them again; a step before it that the file lacks (a
        torn or lost last write) is restored from the checkpoint's copy ``saved`` (``checkpoint_tail``), and one
        missing from both is named in a warning. Wall-clock continues from the last record kept. ``step`` 0: a new
        run over an earlier one's records (a warm-up run again)."""
        saved = saved or {"metrics": [], "samples": []}
        self._file.close()
        kept = [r for r in read_metrics(self.path.parent) if r["step"] < step] if self.path.exists() else []
        kept, restored, lost = merge_metrics(kept, saved["metrics"], step)
        _rewrite(self.path, kept)
        _say_restored(self.path, step, restored, lost)
        rows = [r for r in read_jsonl(self.samples_path) if r["step"] < step] if self.samples_path.exists() else []
        if rows or saved["samples"]:
            _rewrite(self.samples_path, merge_samples(rows, saved["samples"], step))
        self._file = open(self.path, "a", buffering=1)
        self._resumed_wall = kept[-1]["wall_s"] if kept else 0.0
        self._start = time.time() - self._resumed_wall
        self._first = step
        self._fan_out("resume_at", step)

    def log(self, step: int, values: dict[str, Any], samples: Sequence[Sample] = ()) -> None:
        """Record one step (with its ``samples``: their length histogram, and every ``samples_every`` steps a table
        of completions) and print its progress line every ``log_every`` steps."""
        if self._hparams is not None:
            self._fan_out("log_hparams", self._hparams)
            self._hparams = None
        values = {key: plain_scalar(value) for key, value in values.items()}
        record = {"step": step, "wall_s": round(time.time() - self._start, 3), **values}
        line = json.dumps(record, default=float)
        with writing(self.path):
            self._file.write(line + "\n")
        self._tail["metrics"].append(json.loads(line))  # as the file has it
        self._fan_out("log_metrics", step, self._scalars(record),
                      {"response_len_hist": [len(s.response_ids) for s in samples]} if samples else {})
        if samples and self._samples_every and step % self._samples_every == 0:
            rows = completion_rows(samples, self._tokenizer, step)
            with writing(self.samples_path), open(self.samples_path, "a") as f:
                f.writelines(json.dumps(dataclasses.asdict(row)) + "\n" for row in rows)
            self._tail["samples"].extend(dataclasses.asdict(row) for row in rows)
            self._fan_out("log_samples", step, rows)
        done = step + 1
        if done % self._log_every and done != self._total and step != self._first:
            return
        elapsed = time.time() - self._start - self._resumed_wall  # this process's time: the ETA's rate
        eta = elapsed / max(done - self._first, 1) * (self._total - done)
        print(f"[{done:>5}/{self._total}] {self._progress(values)} eta {eta / 60:.1f} min", file=sys.stderr,
              flush=True)

    def close(self) -> None:
        """Flush and close, the trackers too."""
        self._file.close()
        self._fan_out("close")
        self._trackers = []

    def _scalars(self, record: dict[str, Any]) -> dict[str, int | float]:
        """The record's numbers for the trackers (``step`` is their x-axis); the first time a metric is not a number
        it is named in a warning (metrics.jsonl keeps it)."""
        out = {}
        for key, value in record.items():
            number = tracker_value(value)
            if number is not None:
                out[key] = number
            elif key not in self._not_numbers and not _is_number_list(value):  # a list is metrics.jsonl's only
                self._not_numbers.add(key)
                logger.warning("metric %s=%r is not a number: it is in metrics.jsonl only, not in the trackers",
                               key, value)
        out.pop("step")
        return out

    def _fan_out(self, method: str, *args: Any) -> None:
        """``tracker.method(*args)`` for each tracker. A tracker that fails (a server gone) is named in a warning and
        gets nothing more: the run and metrics.jsonl go on."""
        for tracker in list(self._trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as exc:  # any backend's error: the run must not die of its tracker
                logger.warning("%s failed (%s: %s): it gets nothing more; metrics.jsonl has every step",
                               type(tracker).__name__, type(exc).__name__, exc)
                self._trackers.remove(tracker)


def _say_restored(path: Path, start: int, restored: list[int], lost: list[int]) -> None:
    """A resume at step ``start`` that found steps before it missing from ``path``: which came back from the
    checkpoint's copy of the log, which are lost."""
    if restored:
        logger.warning("%s: the record(s) of step(s) %s were missing (a torn or lost write): restored from the "
                       "checkpoint's copy of the log", path, steps_text(restored))
    if lost:
        logger.warning("%s: the record(s) of step(s) %s are missing and not in the checkpoint's copy of the log "
                       "(step %d's, which holds the steps since the previous checkpoint): they stay missing", path,
                       steps_text(lost), start)


def open_metrics_log(config: Config, tokenizer, progress: Callable[[dict[str, Any]], str] = grpo_progress,
                     resume: bool | None = None) -> MetricsLog:
    """The metrics log of a run of ``config`` (``train.out_dir``, ``train.loggers``, ...), its config given to the
    trackers; ``tokenizer`` decodes the completion tables. ``resume``: continue the trackers' runs (default
    ``train.resume``)."""
    t: TrainConfig = config.train
    run_dir = Path(t.out_dir)
    optional = ("tensorboard",) if t.loggers == TrainConfig().loggers else ()  # the default's: skipped when missing
    trackers = make_trackers(t.loggers, run_dir, t.project, t.run_name, t.resume if resume is None else resume,
                             optional)
    return MetricsLog(run_dir, t.steps, trackers, t.log_every, t.samples_every, tokenizer, progress, config.to_dict())


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All step records of a run (the last record wins for a step logged twice, e.g. around a resume).

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` there. ValueError: a record that is not JSON (a torn last line is
            skipped, ``read_jsonl``), without an integer ``step`` >= 0 or with a non-numeric ``wall_s``, naming
            file and line. Any other metric whose value is not a number (nor a list of numbers) is dropped from its
            record with a warning naming file, line and key: the report of the rest can still be drawn.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    by_step = {}
    for line, record in numbered_records(path):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            what = "has no step" if "step" not in record else f"step={step!r} is not a step number (an integer >= 0)"
            raise ValueError(f"{path}:{line}: the record {what}")
        if not _is_number(record.get("wall_s", 0.0)):
            raise ValueError(f"{path}:{line}: wall_s={record['wall_s']!r} is not a number")
        if bad := [key for key, value in record.items() if not (_is_number(value) or value is None
                                                                 or _is_number_list(value))]:
            shown = ", ".join(f"{key}={record.pop(key)!r}" for key in bad)
            logger.warning("%s:%d: %s: not a number, skipped", path, line, shown)
        by_step[step] = record
    return [by_step[k] for k in sorted(by_step)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bools included: ``skipped``


def numbered_records(path: Path, warn_torn: bool = True) -> list[tuple[int, dict[str, Any]]]:
    """The records of a JSON-lines file with their 1-based line numbers, in order (blank lines skipped). Only a
    run's last write can be torn (killed, or a full disk, while writing it): an unreadable last line is skipped with
    a warning naming file and line (``cut_torn_tail`` removes it before a resume appends).

    Raises:
        ValueError: any other line that is not a JSON object, naming file and line.
    """
    lines = path.read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == last:
                if warn_torn:
                    logger.warning("%s:%d: a torn last record (the run stopped while writing it): skipped", path,
                                   number)
                break
            raise ValueError(f"{path}:{number}: not a JSON record ({exc.msg}, column {exc.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: a JSON {type(record).__name__}, not a record")
        out.append((number, record))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file, in order (``numbered_records`` without the line numbers)."""
    return [record for _, record in numbered_records(path)]


def cut_torn_tail(path: Path) -> int | None:
    """Cut an unreadable last line (a torn last write) off ``path``; returns its 1-based line number, or None when
    the last line reads. Lines before it are not checked here (``numbered_records`` names a bad one)."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    if not last:
        return None
    try:
        json.loads(lines[last - 1])
        return None
    except json.JSONDecodeError:
        pass
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines[:last - 1]))
    tmp.replace(path)
    return last


def _rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace ``path`` by ``records``, one JSON line each (atomic)."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(tmp):
        tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in records))
    tmp.replace(path)
