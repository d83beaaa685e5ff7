"""The one megatron format: ``hf-to-megatron`` writes a megatron dist checkpoint (Megatron-LM's ``--load`` layout),
``megatron-to-hf`` reads it back bit-exactly, and ``model.init=megatron`` starts the trainer's policy from it at
another layout than it was written at, equal to ``model.init=hf``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import REPO, run_torchrun, save_hf_model, tiny_hf_config

WORKER = REPO / "tests" / "workers" / "megatron_init_worker.py"
CONVERT = REPO / "checkpoint_tools" / "hf_to_megatron.py"


def _hf_model(tmp_path, model_type="qwen2"):
    return save_hf_model(tiny_hf_config(model_type, tied=model_type == "qwen2"), tmp_path / f"hf-{model_type}")


def _convert(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "checkpoint_tools.hf_to_megatron", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_hf_to_megatron_writes_a_dist_checkpoint_in_megatron_lms_layout_that_exports_bit_exactly(tmp_path):
    from checkpoint_tools._dist import checkpoint_kind, megatron_to_hf_any, resolve_checkpoint

    hf = _hf_model(tmp_path)
    out = tmp_path / "megatron"
    proc = _convert("--hf", str(hf), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
    release = resolve_checkpoint(out)
    assert release == out / "release" and checkpoint_kind(out) == "dist"
    assert {"metadata.json", "common.pt", "offgrpo_model.json"} <= {p.name for p in release.iterdir()}
    assert json.loads((release / "offgrpo_model.json").read_text())["hf_config"]["hidden_size"] == 64
    # what Megatron-LM's loader reads before any tensor
    common = torch.load(release / "common.pt", weights_only=False)
    assert common["checkpoint_version"] == 3.0 and common["args"].tensor_model_parallel_size == 1
    megatron_to_hf_any(out, tmp_path / "back")
    source, back = _tensors(hf), _tensors(tmp_path / "back")
    assert source.keys() == back.keys()
    assert all(torch.equal(source[k], back[k]) and source[k].dtype == back[k].dtype for k in source)
    again = _convert("--hf", str(hf), "--out", str(out))  # an earlier output is never replaced silently
    assert again.returncode == 2 and "--overwrite" in again.stderr and again.stderr.count("\n") == 1
    assert _convert("--hf", str(hf), "--out", str(out), "--overwrite").returncode == 0


def test_a_layout_needs_its_processes(tmp_path):
    hf = _hf_model(tmp_path)
    proc = _convert("--hf", str(hf), "--out", str(tmp_path / "m"), "--tp", "2")
    assert proc.returncode == 2 and "torchrun --nproc_per_node 2" in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()


@pytest.mark.multiproc
@pytest.mark.parametrize("model_type,written,loaded", [
    ("qwen2", ("--tp", "2"), ("1", "2", "1")),   # written at TP2, trained at PP2
    ("qwen3_moe", ("--ep", "2"), ("2", "1", "1")),  # written at EP2, trained at TP2 (experts split over TP)
])
def test_init_megatron_starts_the_policy_where_init_hf_does_at_another_layout(tmp_path, model_type, written, loaded):
    hf = _hf_model(tmp_path, model_type)
    out = tmp_path / "megatron"
    run_torchrun(CONVERT, 2, ["--hf", str(hf), "--out", str(out), *written])
    proc = run_torchrun(WORKER, 2, [str(hf), str(out), *loaded, "1"])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MEGATRON_INIT"))
    report = dict(part.split("=") for part in line.split()[1:])
    assert int(report["params"]) > 0 and int(report["differing"]) == 0, line
    assert float(report["probe_diff"]) == 0.0, line
