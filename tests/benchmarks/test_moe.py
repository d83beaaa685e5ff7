"""benchmarks/moe.py end to end at its smallest: the three layouts launch under torchrun (gloo), train the trainer's
step on the tiny Qwen3-MoE and export it; the JSON has every layout with positive times, EP=2 holds half of the
experts per rank, and every layout exports the same HF checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "moe.py"


@pytest.mark.multiproc
@pytest.mark.slow
def test_smallest_run_reports_every_layout(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--rounds", "1", "--samples", "8",
                           "--group-size", "4", "--median", "24", "--max-response", "48", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "moe.json").read_text())
    rows = {row["layout"]: row for row in result["rows"]}
    assert list(rows) == ["ep1", "dp2-ep1", "dp2-ep2"]
    for name, row in rows.items():
        assert row["step s (median)"] > 0 and row["refresh export ms (median)"] > 0, row
        assert f"| {name} |" in proc.stdout
    assert (rows["ep1"]["experts/rank"], rows["dp2-ep2"]["experts/rank"]) == ("8 of 8", "4 of 8")
    assert rows["dp2-ep2"]["expert params/rank (M)"] * 2 == pytest.approx(rows["ep1"]["expert params/rank (M)"],
                                                                         abs=2e-3)
    assert len({row["exported"] for row in rows.values()}) == 1  # EP gathers the same 69-tensor checkpoint
    assert set(result["ratios"]) == {"dp2-ep2 / ep1", "dp2-ep2 / dp2-ep1", "dp2-ep1 / ep1"}
    assert all(r["step"] > 0 and r["refresh"] > 0 for r in result["ratios"].values())
    for launches in result["launches"].values():
        assert len(launches) == 1 and len(launches[0]["step_s"]) == 1


def test_help_lists_the_flags_and_bad_layouts_are_refused():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    helped = subprocess.run([sys.executable, str(SCRIPT), "--help"], env=env, capture_output=True, text=True)
    assert helped.returncode == 0 and "--layouts" in helped.stdout and "--worker" not in helped.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--layouts", "ep4"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown ['ep4']" in bad.stderr
