"""benchmarks/gpu_step.py in its CPU mode (tiny Qwen2, fp32): the real build_policy / policy_step path runs, the
tables have their columns and a positive throughput, and the FLOP count matches the formula worked by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

from megatron_offgrpo.model import load_arch
from tests.helpers import REPO

SCRIPT = REPO / "benchmarks" / "gpu_step.py"
STEP_COLUMNS = ["model", "device", "precision", "layer spec", "layers", "loss impl", "tokens/step", "loss tokens/step",
                "step s (median)", "tokens/s", "TFLOP/s", "MFU", "GPU busy", "host syncs/step", "peak GiB", "loss"]
LOSS_COLUMNS = ["impl", "N x V", "fwd+bwd ms (median)", "peak extra MiB", "loss", "loss diff vs torch",
                "grad rel diff vs torch", "status"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, *extra: str, device: str = "cpu") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, str(SCRIPT), "--device", device, "--tiny", "--out", str(tmp_path), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _tables(text: str) -> list[list[dict]]:
    """Every markdown table of ``text`` as a list of rows (column -> cell)."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip("|").split("|")))))
            tables.append((header, rows))
    return tables


def test_cpu_mode_trains_and_reports(tmp_path):
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (step_header, (step,)), (loss_header, losses) = _tables(proc.stdout)
    assert step_header == STEP_COLUMNS and loss_header == LOSS_COLUMNS
    # --tiny: 2 micro-batches x 4 sequences x 32 positions = 256 positions; each sequence has 33 tokens, 8 of
    # them prompt, so 25 response positions enter the loss: 8 x 25 = 200
    assert (step["device"], step["precision"], step["layer spec"]) == ("cpu", "fp32", "local")
    assert int(step["tokens/step"]) == 256 and int(step["loss tokens/step"]) == 200
    assert float(step["tokens/s"]) > 0 and math.isfinite(float(step["loss"]))
    assert float(step["tokens/s"]) * float(step["step s (median)"]) == pytest.approx(256, rel=1e-2)
    assert step["MFU"] == "n/a (CPU)" and step["loss impl"] == "torch"
    by_impl = {row["impl"]: row for row in losses}
    assert list(by_impl) == ["torch", "triton", "liger", "naive"]
    assert by_impl["torch"]["status"] == "ok" and float(by_impl["torch"]["fwd+bwd ms (median)"]) > 0
    assert by_impl["triton"]["status"] == "needs CUDA"
    assert by_impl["liger"]["status"] in ("ok", "liger-kernel not installed")
    # the naive materialised logits compute the same loss and gradients as the fused torch path (fp32)
    assert by_impl["naive"]["status"] == "ok" and float(by_impl["naive"]["grad rel diff vs torch"]) < 1e-5
    assert by_impl["torch"]["peak extra MiB"] == "-"  # device memory is read on CUDA only
    written = (tmp_path / "gpu_step.md").read_text()
    assert written.strip() in proc.stdout and _tables(written)[0][1][0] == step
    assert json.loads((tmp_path / "gpu_step.json").read_text())["steps"][0]["tokens/s"] == float(step["tokens/s"])


@pytest.mark.gpu
def test_cuda_mode_trains_and_every_loss_path_agrees(tmp_path):
    """The GPU twin of the CPU mode: the policy is built on the GPU (the first GPU run found the local spec's norms
    left on the host, which megatron's bf16 optimizer refused) and every loss path agrees with the torch one."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    proc = _run(tmp_path, "--precision", "bf16", device="cuda")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (_, (step,)), (_, losses) = _tables(proc.stdout)
    assert step["loss impl"] == "triton" and step["MFU"].endswith("%") and math.isfinite(float(step["loss"]))
    for row in losses:
        assert row["status"] in ("ok", "liger-kernel not installed"), row
        assert row["status"] != "ok" or int(row["peak extra MiB"]) >= 0


def test_fp8_without_transformer_engine_is_refused(tmp_path):
    from megatron_offgrpo.runtime import have_te

    if have_te():
        pytest.skip("Transformer Engine is usable here: fp8 runs")
    proc = _run(tmp_path, "--precision", "fp8", "--fp8-recipe", "blockwise")
    assert proc.returncode == 2 and "model.precision='fp8' needs Transformer Engine" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "gpu_step.md").exists()


def test_flop_count_by_hand():
    arch = load_arch(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2")
    # tiny Qwen2: L=2, H=128, 2 query heads and 2 KV heads of 64 -> d_q = d_kv = 128, I=384, V=151936.
    # per layer: QKV 128*(128+2*128)=49152, O 128*128=16384, SwiGLU 3*128*384=147456 -> 212992
    body = 6 * 2 * 212992 * 256               # T = 256 positions
    attention = 12 * 2 * 128 * 32 * 256       # s = 32 positions per sequence
    head = 6 * 151936 * 128 * 200             # the output layer on the 200 loss tokens only
    assert _module().step_flops(arch, positions=256, seq=32, loss_tokens=200) == body + attention + head


def test_flop_count_of_a_moe_counts_the_experts_a_token_meets():
    arch = load_arch(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen3-moe")
    # tiny Qwen3-MoE: L=2, H=128, d_q = d_kv = 128, 8 experts of I=64, top-2: per layer QKV 49152, O 16384,
    # router 128*8 = 1024, two experts' SwiGLUs 2*3*128*64 = 49152 -> 115712 (not all eight experts' 196608)
    body = 6 * 2 * 115712 * 256
    attention = 12 * 2 * 128 * 32 * 256
    head = 6 * 151936 * 128 * 200
    assert _module().step_flops(arch, positions=256, seq=32, loss_tokens=200) == body + attention + head


def test_cpu_mode_trains_a_moe_cut_to_fewer_layers(tmp_path):
    proc = _run(tmp_path, "--config", str(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen3-moe"), "--layers", "1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (_, (step,)), _ = _tables(proc.stdout)
    assert step["model"] == "tiny-qwen3-moe (1 layers), 8 experts top-2" and step["layer spec"] == "local"
    assert math.isfinite(float(step["loss"])) and float(step["tokens/s"]) > 0
    proc = _run(tmp_path, "--config", str(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen3-moe"), "--layers", "3")
    assert proc.returncode != 0 and "--layers 3: tiny-qwen3-moe has 2" in proc.stderr


@pytest.mark.gpu
def test_cuda_mode_trains_qwen3_moe_layers(tmp_path):
    """Qwen3-30B-A3B's real layer shapes (2 of its 48 layers, 128 experts top-8) trained on the GPU: with Transformer
    Engine its experts run as one grouped GEMM, without it the local spec's experts."""
    import torch

    from megatron_offgrpo.runtime import have_te

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = REPO / "megatron_offgrpo" / "assets" / "qwen3-30b-a3b-config"
    proc = _run(tmp_path, "--config", str(config), "--layers", "2", "--precision", "bf16", device="cuda")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (_, (step,)), _ = _tables(proc.stdout)
    assert step["model"] == "qwen3-30b-a3b-config (2 layers), 128 experts top-8"
    assert step["layer spec"] == ("transformer-engine, grouped-GEMM experts" if have_te() else "local")
    assert math.isfinite(float(step["loss"])) and step["MFU"].endswith("%")


def test_every_flag_is_documented():
    import re

    docs = (REPO / "docs" / "benchmarks.md").read_text()
    section = docs[docs.index("### Flags of `python benchmarks/gpu_step.py`"):]
    flags = re.findall(r'add_argument\("(--[a-z0-9-]+)"', SCRIPT.read_text())
    assert len(flags) > 10
    missing = [f for f in flags if f"`{f}" not in section]
    assert not missing, f"docs/benchmarks.md does not document {missing}"
