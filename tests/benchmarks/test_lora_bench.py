"""benchmarks/lora.py on the tiny Qwen2: each variant in its own process through gpu_step.py's real step, one table
with the ratios against full fine-tuning; the adapters' parameter count is the arithmetic of their shapes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_the_lora_benchmark_runs_each_variant_and_prints_its_ratios(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/lora.py", "--tiny", "--variants", "full,lora-r1",
                           "--steps", "1", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {row["variant"]: row for row in json.loads((tmp_path / "lora.json").read_text())}
    assert rows["full"]["step vs full"] == "1.00x" and rows["lora-r1"]["peak vs full"].endswith("x")
    # tiny-qwen2: 2 layers x r=1 x (in + out) of qkv (128 + 384), proj (128 + 128), fc1 (128 + 768), fc2 (384 + 128)
    assert rows["lora-r1"]["trained parameters"] == f"{2 * (512 + 256 + 896 + 512):,}"
    assert rows["lora-r1"]["peak GiB"] < rows["full"]["peak GiB"]  # no grads, no Adam moments for 39M weights
    assert "| lora-r1 |" in proc.stdout
