"""``optim.packing`` in the warm-up: ``offgrpo sft`` packs its reference answers into rows like the RL step does, and
takes the padded layout's steps (GSM8K prompts: their lengths vary, so the packs hold several sequences a row)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.train.conftest import metrics, train_env

SFT = ["--config", "configs/tiny-cpu-sft.yaml", "data.name=gsm8k", "data.max_prompt_tokens=256", "data.count=64",
       "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=3", "train.log_every=1",
       "optim.micro_batch_tokens=2048"]


@pytest.mark.slow
def test_packed_warm_up_takes_the_padded_steps(tmp_path):
    runs = {}
    for packing in ("false", "true"):
        out = tmp_path / f"packing-{packing}"
        proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "sft", *SFT, f"optim.packing={packing}",
                               f"train.out_dir={out}"], cwd=REPO, env=train_env(), capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-6000:]
        runs[packing] = metrics(out)
    padded, packed = runs["false"], runs["true"]
    assert [r["tokens"] for r in padded] == [r["tokens"] for r in packed]
    for a, b in zip(padded, packed):  # the same gradient, so the same losses step after step
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
