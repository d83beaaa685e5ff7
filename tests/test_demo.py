"""`make demo`, the README's first command, run for real as a user runs it: warm-up, GRPO at v=4 and v=1, report.

It runs in a mirror of the repo root (symlinks, the repo's .venv) so its runs/ land in a temporary directory. What
it holds: every stage exits 0; the first RL run is off-policy (v = 4) and the second on-policy (v = 1); each is
evaluated before and after on the 20 held-out questions neither stage trains on, and raises greedy accuracy there by at
least 0.2 (the warm-up's teacher gave a + b + 1 more often than a + b: seed 1234 starts at 0.50 and ends at 0.80
after either run, measured 2026-11-26);
the trained policy is exported as HF weights and the report names both runs' accuracies.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_make_demo(tmp_path):
    for entry in REPO.iterdir():
        if entry.name not in (".git", "runs"):
            (tmp_path / entry.name).symlink_to(entry)
    proc = subprocess.run(["make", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for name, v in (("tiny-cpu", 4), ("tiny-cpu-v1", 1)):
        run = tmp_path / "runs" / name
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        versions = sorted({r["policy_version"] for r in records})
        assert versions == list(range(0, len(records), v)), (name, versions)  # refreshed every v steps
        start, end = records[0]["eval_start_accuracy"], records[-1]["eval_accuracy"]
        assert end >= start + 0.2, f"{name}: greedy held-out accuracy {start} -> {end}: RL gained less than 0.2"
        assert records[-1]["eval_version"] == len(records)  # the trained policy itself was evaluated
        assert f"greedy held-out accuracy {start:.3f} (step 0) -> {end:.3f} (step {len(records)})" in proc.stdout
        assert (run / "hf" / "model.safetensors").exists()
    assert (tmp_path / "runs" / "tiny-cpu" / "report.png").exists()
    assert "Traceback" not in proc.stderr
