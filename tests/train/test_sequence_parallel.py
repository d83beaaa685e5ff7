"""Sequence parallelism under torchrun (gloo): the trainer's optimizer steps (padded then packed rows of an odd
length, so rows are padded to a multiple of tp; behavior log-probs recomputed; the KL reference; router replay for
MoE) at TP2 with SP equal the single-process steps for the tiny Qwen3-MoE, whole experts (etp=1) included; a dense
model at TP2 gives the same step with SP on and off; `offgrpo train` runs the MoE at tp=2
(tests/workers/sp_step_worker.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import REPO, run_torchrun, save_hf_model, tiny_hf_config
from tests.train.conftest import metrics, train_proc

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORKER = REPO / "tests" / "workers" / "sp_step_worker.py"
PROMPT_LENGTH, RESPONSE_LENGTHS = 5, (3, 6, 9, 4, 5, 7, 2, 8)  # the worker's samples
ADAM_EPS_ELEMENTS = 2  # see _assert_same_steps


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("sp_models")
    return {kind: str(save_hf_model(tiny_hf_config(kind, layers=2), root / kind)) for kind in ("qwen3_moe", "qwen3")}


def _steps(tmp_path, hf_dir: str, nproc: int, *overrides: str) -> dict:
    out = tmp_path / f"steps.{nproc}.{'.'.join(overrides) or 'single'}.pt"
    proc = run_torchrun(WORKER, nproc, [str(out), hf_dir, *overrides])
    tp = 2 if "parallel.tp=2" in overrides else 1
    assert f"DONE tp={tp}" in proc.stdout, proc.stdout[-2000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def moe_single(hf_dirs, tmp_path_factory) -> dict:
    return _steps(tmp_path_factory.mktemp("moe_single"), hf_dirs["qwen3_moe"], 1)


def _assert_same_steps(a: dict, b: dict, weight_tol: float) -> float:
    """Both steps' loss and metrics to 1e-5 relative, the router's tokens per expert exactly (the rows differ in
    length, but pad positions are not counted), the updated weights to ``weight_tol``; returns the worst weight
    difference.

    Adam's first step is ``lr * g / (|g| + eps)``: for a gradient element within a few eps of 0 (1e-8), a 1e-9
    difference in summation order moves the update by a sizeable part of lr (measured: 1 element of 4,096 moved
    2.8e-5 at lr 1e-3). Up to ``ADAM_EPS_ELEMENTS`` elements per tensor may exceed ``weight_tol`` by that much.
    """
    for sa, sb in zip(a["steps"], b["steps"]):
        for key, value in sa.items():
            if isinstance(value, float) and math.isfinite(value):
                assert sb[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert sa.get("moe_tokens_per_expert") == sb.get("moe_tokens_per_expert")
    worst = 0.0
    for wa, wb in zip(a["weights"], b["weights"]):
        assert sorted(wa) == sorted(wb)
        for name, tensor in wa.items():
            diff = (tensor - wb[name]).abs()
            worst = max(worst, diff.max().item())
            assert (diff > weight_tol).sum() <= ADAM_EPS_ELEMENTS and diff.max() <= 5e-5, name
    return worst


@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.etp=1"],
                                    ["parallel.tp=2", "parallel.pp=2"]], ids=["tp2", "tp2-etp1", "tp2-pp2"])
def test_moe_steps_at_tp2_with_sequence_parallelism_equal_single_process(hf_dirs, moe_single, tmp_path, layout):
    """tp2-pp2: the second stage is handed its own part of each row's pad mask (megatron splits it in the first)."""
    split = _steps(tmp_path, hf_dirs["qwen3_moe"], 2 * (2 if "parallel.pp=2" in layout else 1), *layout)
    positions = sum(PROMPT_LENGTH + n - 1 for n in RESPONSE_LENGTHS)  # every sample's, pads left out
    for step in moe_single["steps"]:  # padded, then packed: rows of other lengths, the same count
        assert sum(step["moe_tokens_per_expert"]) == positions * 2 * 2  # 2 layers, top-2
    worst = _assert_same_steps(moe_single, split, weight_tol=1e-5)
    print(f"{layout}: worst weight difference {worst:.2e}")


def test_dense_step_at_tp2_is_the_same_with_and_without_sequence_parallelism(hf_dirs, tmp_path):
    plain = _steps(tmp_path, hf_dirs["qwen3"], 2, "parallel.tp=2")
    split = _steps(tmp_path, hf_dirs["qwen3"], 2, "parallel.tp=2", "parallel.sequence_parallel=true")
    worst = _assert_same_steps(plain, split, weight_tol=1e-6)
    print(f"dense tp2 SP on vs off: worst weight difference {worst:.2e}")


def test_moe_trains_end_to_end_at_tp2(tmp_path):
    """`offgrpo train` of the tiny MoE at tp=2 (sequence parallelism on by default), replaying the engine's routing."""
    train_proc(2, tmp_path, "model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe", "parallel.tp=2",
               "model.router_replay=true", "train.steps=2", "rollout.refresh_every=1")
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1]
    for r in records:
        assert math.isfinite(r["loss"]) and not r["skipped"] and r["moe_aux_loss"] > 0
        # every sample's position (pads left out), top-2, in each of the 2 layers, counted once over the two TP ranks
        assert len(r["moe_tokens_per_expert"]) == 8 and sum(r["moe_tokens_per_expert"]) % (2 * 2) == 0
