"""The checkpoint's copy of the run's log, and what a resume does with the records it finds.

The order that keeps ``metrics.jsonl`` and the checkpoints in agreement: the records of the steps a checkpoint holds
are fsynced before the checkpoint is published (its rename), so a crash can leave records past the newest checkpoint
(the resume drops them and logs those steps again), never a checkpoint past its records. The checkpoint also keeps
the records and completion rows logged since the previous one (``log_tail.json``): a resume that finds one of those
steps missing anyway (a torn or lost last write, a disk that dropped it) restores it from there, and names any step
missing from both. Torch-free: the run directory's checks read it before the libraries load.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STATE = "trainer_state.json"
TAIL_FILE = "log_tail.json"
UNCOMPARED_KEYS = ("train.resume", "train.overwrite", "train.steps", "train.async_save")
"""Config keys a resume does not compare with the checkpoint's run (``changed_keys``): how a resume is asked for, the
schedule's length (the resume's schedule line says what changed), how checkpoints are written."""

Record = dict[str, Any]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (``trainer_state.json`` present), or None."""
    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / STATE).exists())
    return done[-1] if done else None


def sweep_partial(run_dir: str | Path) -> list[Path]:
    """Remove the ``step_X.tmp`` directories a killed save left (never loadable: the rename is the commit); returns
    them. Only the run's rank 0 calls it, before the run writes any checkpoint."""
    swept = sorted((Path(run_dir) / "checkpoints").glob("step_*.tmp"))
    for path in swept:
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("removed %s, left by a checkpoint save that was interrupted", path)
    return swept


def changed_keys(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """``section.key old -> new`` for every config key whose value differs from the checkpoint's run (the
    objective may have changed); [] for a checkpoint without its config."""
    return [f"{section}.{key} {value!r} -> {now[section][key]!r}" for section, keys in (saved or {}).items()
            for key, value in keys.items() if key in now.get(section, {}) and now[section][key] != value
            and f"{section}.{key}" not in UNCOMPARED_KEYS]


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint was taken after."""
    return int(json.loads((Path(path) / STATE).read_text())["step"])


def read_log_tail(checkpoint: str | Path | None) -> dict[str, list[Record]]:
    """The checkpoint's copy of the log: ``{"metrics": [...], "samples": [...]}`` (empty lists for a checkpoint
    written before it had one, or none)."""
    path = None if checkpoint is None else Path(checkpoint) / TAIL_FILE
    try:
        tail = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # damaged: the resume goes on without the copy
        logger.warning("%s: unreadable (%s): the resume restores no record from it", path, exc)
        tail = {}
    tail = tail if isinstance(tail, dict) else {}
    return {"metrics": list(tail.get("metrics", [])), "samples": list(tail.get("samples", []))}


def merge_metrics(kept: list[Record], saved: list[Record], start: int) -> tuple[list[Record], list[int], list[int]]:
    """The records a run resumed at ``start`` continues from: ``kept`` (the file's, steps before ``start``) with the
    checkpoint's ``saved`` ones filling the steps the file lacks. Returns (records by step, the steps restored from
    ``saved``, the steps before ``start`` in neither)."""
    by_step = {r["step"]: r for r in kept}
    restored = sorted(r["step"] for r in saved if r["step"] < start and r["step"] not in by_step)
    by_step |= {r["step"]: r for r in saved if r["step"] in restored}
    lost = [s for s in range(start) if s not in by_step]
    return [by_step[s] for s in sorted(by_step)], restored, lost


def merge_samples(kept: list[Record], saved: list[Record], start: int) -> list[Record]:
    """Completion rows of the steps before ``start``: a step the checkpoint's copy has rows of takes them all from
    there (the file's may end in a torn row), the others keep the file's."""
    from_copy = {r["step"] for r in saved if r["step"] < start}
    rows = [r for r in kept if r["step"] not in from_copy] + [r for r in saved if r["step"] in from_copy]
    return sorted(rows, key=lambda r: r["step"])  # stable: a step's rows keep their order


def steps_text(steps: list[int]) -> str:
    """``[7, 8, 9, 12]`` as ``7-9, 12``."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def torn_fate(name: str, last_kept: int | None, run_dir: Path) -> str:
    """What the resume does with the step of ``name``'s torn last line (cut off), for the warning that says so.
    ``last_kept``: the step of the last line that reads (None: none does)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return "the resume starts at step 0 (no complete checkpoint) and logs every step again"
    start, tail = checkpoint_step(checkpoint), read_log_tail(checkpoint)
    if name != "metrics.jsonl":
        copied = sorted({r["step"] for r in tail["samples"] if r["step"] < start})
        restored = f"; those of steps {steps_text(copied)} come from {checkpoint.name}'s copy of the log" if copied \
            else ""
        return f"the resume (at step {start}) logs the completions of steps {start} on again{restored}"
    torn = 0 if last_kept is None else last_kept + 1  # records are in step order
    if torn >= start:
        return f"the resume starts at step {start} and logs step {torn} again"
    if any(r["step"] == torn for r in tail["metrics"]):
        return f"its step {torn} is before the resume's (step {start}): restored from {checkpoint.name}'s copy of " \
               "the log"
    return f"its step {torn} is before the resume's (step {start}) and not in {checkpoint.name}'s copy of the log: " \
           "that step's record is lost"
