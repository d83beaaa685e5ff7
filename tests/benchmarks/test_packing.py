"""benchmarks/packing.py at toy sizes: the trainer's step runs in all three layouts, the table and the JSON agree, and
the ratios are the rows' (shared prompts cut the positions a step computes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


def test_toy_run_reports_every_layout_and_its_ratios(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "packing.py"), "--hidden", "64", "--layers", "1", "--vocab", "512",
         "--samples", "8", "--group-size", "4", "--median", "16", "--max-response", "64", "--budget", "1024",
         "--repeats", "1", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "packing.json").read_text())
    rows = {row["layout"]: row for row in result["rows"]}
    assert list(rows) == ["padded", "packed", "shared"]
    assert "| layout | micro-batches |" in proc.stdout and "|---|" in proc.stdout
    for layout, row in rows.items():
        assert f"| {layout} | {row['micro-batches']} |" in proc.stdout and row["real tokens/s"] > 0
    # 2 prompts of 4 samples: the shared layout writes each prompt once, so it computes fewer positions
    assert rows["shared"]["positions"] < rows["padded"]["positions"]
    ratio = result["ratios"]["shared vs padded"]
    assert ratio["positions"] == pytest.approx(rows["shared"]["positions"] / rows["padded"]["positions"], abs=1e-3)
