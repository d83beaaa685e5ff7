"""`make demo`, the README's first command, run for real as a user runs it: warm-up, off-policy GRPO, report.

It runs in a mirror of the repo root (symlinks, the repo's .venv) so its runs/ land in a temporary directory. What
it holds: every stage exits 0; the warm-up left the plateau (greedy held-out accuracy of its policy, measured by the
RL run before its first update, at least 0.4 on a, b <= 7: 0.52 measured, where a, b <= 5 make 36 of the 64
pairs; a model on the plateau guesses the marginal of the sums); the RL run is
off-policy (v = 4), evaluated before and after, exports its policy as HF weights, and the report names both accuracies.
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
    run = tmp_path / "runs" / "tiny-cpu"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    versions = sorted({r["policy_version"] for r in records})
    assert versions == list(range(0, len(records), 4)), versions  # refreshed every 4 steps, never on-policy
    start, end = records[0]["eval_start_accuracy"], records[-1]["eval_accuracy"]
    assert start >= 0.4, f"the warm-up stayed on its plateau: greedy accuracy {start} before RL"
    assert records[-1]["eval_version"] == len(records)  # the trained policy itself was evaluated
    assert f"greedy held-out accuracy {start:.3f} (step 0) -> {end:.3f} (step {len(records)})" in proc.stdout
    assert (run / "hf" / "model.safetensors").exists() and (run / "report.png").exists()
    assert "Traceback" not in proc.stderr
