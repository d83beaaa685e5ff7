"""Run metrics: one JSON line per step (always), TensorBoard scalars (when installed), a console progress line."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def plain_scalar(value: Any) -> Any:
    """A 0-d torch tensor or numpy scalar as the Python number it holds; anything else unchanged.

    Metrics arrive as whatever computed them (a loss tensor, a ``np.float64`` mean): TensorBoard takes Python numbers
    only, and JSON's ``default=float`` would turn an integer or bool scalar into a float.
    """
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()  # torch.Tensor (0-d) and np.generic both have ndim 0 and item()
    return value


class MetricsLog:
    """Writes ``RUN/metrics.jsonl`` and ``RUN/tensorboard/``; only rank 0 creates one."""

    def __init__(self, run_dir: Path, total_steps: int) -> None:
        """Args: run_dir: the run directory. total_steps: for the progress display."""
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._total = total_steps
        self._start = time.time()
        self._first, self._resumed_wall = 0, 0.0  # a resumed run: its first step, the wall-clock it had reached
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:  # tensorboard is optional: JSONL holds everything
            self._tb = None
            logger.info("tensorboard not installed: metrics go to %s only", self.path)

    def resume_at(self, step: int) -> None:
        """Continue a resumed run at ``step``: the records of later steps (logged after the checkpoint the run resumes
        from, before it stopped) are dropped, since the run logs them again, and wall-clock continues from the last
        record kept."""
        self._file.close()
        kept = [r for r in read_metrics(self.path.parent) if r["step"] < step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))
        tmp.replace(self.path)
        self._file = open(self.path, "a", buffering=1)
        self._resumed_wall = kept[-1]["wall_s"] if kept else 0.0
        self._start = time.time() - self._resumed_wall
        self._first = step

    def log(self, step: int, values: dict[str, Any]) -> None:
        """Record one step and print its progress line."""
        values = {key: plain_scalar(value) for key, value in values.items()}
        record = {"step": step, "wall_s": round(time.time() - self._start, 3), **values}
        self._file.write(json.dumps(record, default=float) + "\n")
        if self._tb is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
        done = step + 1
        elapsed = time.time() - self._start - self._resumed_wall  # this process's time: the ETA's rate
        eta = elapsed / max(done - self._first, 1) * (self._total - done)
        line = (f"[{done:>5}/{self._total}] reward {values.get('reward_mean', float('nan')):.3f} "
                f"acc {values.get('accuracy', float('nan')):.3f} loss {values.get('loss', float('nan')):+.4f} "
                f"masked {values.get('masked_group_fraction', 0):.2f} clip {values.get('clip_fraction', 0):.3f} "
                f"v{values.get('policy_version', 0)} gen {values.get('time_generate_s', 0):.1f}s "
                f"sync {values.get('time_sync_s', 0):.2f}s train {values.get('time_train_s', 0):.1f}s "
                f"{values.get('tokens_per_s', 0):.0f} tok/s eta {eta / 60:.1f} min")
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        """Flush and close."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All step records of a run (the last record wins for a step logged twice, e.g. around a resume)."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[k] for k in sorted(by_step)]
