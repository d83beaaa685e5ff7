"""LoRA on the megatron policy (``model.lora``, ``lora.*``): the adapters' gradients and updated values at TP2 (with
and without sequence parallelism), PP2 (tied embeddings) and DP2 (distributed optimizer) equal one process's; the
base is bit-identical after the step, and DDP and the optimizer hold the adapters only
(tests/workers/lora_grad_worker.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import REPO, run_torchrun, save_hf_model, tiny_hf_config

WORKER = REPO / "tests" / "workers" / "lora_grad_worker.py"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    # tied embeddings: under PP the output layer's copy of the (frozen) embedding must stay out of the grad sync
    return str(save_hf_model(tiny_hf_config("qwen2", tied=True, layers=2), tmp_path_factory.mktemp("lora") / "m"))


def _step(tmp_path, hf_dir: str, nproc: int, *overrides: str) -> dict:
    out = tmp_path / f"lora.{nproc}.{'.'.join(overrides) or 'single'}.pt"
    proc = run_torchrun(WORKER, nproc, [str(out), hf_dir, *overrides])
    assert "DONE" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory) -> dict:
    return _step(tmp_path_factory.mktemp("single"), hf_dir, 1)


def test_only_the_adapters_train(single):
    # 2 layers x (qkv: 4x64 + 128x4 (q 64 + k 32 + v 32 rows), proj: 4x64 + 64x4, fc1: 4x64 + 192x4, fc2: 4x96 + 64x4)
    per_layer = (4 * 64 + 128 * 4) + (4 * 64 + 64 * 4) + (4 * 64 + 192 * 4) + (4 * 96 + 64 * 4)
    assert single["trained_numel"] == 2 * per_layer
    assert single["buffer_numel"] == single["trained_numel"]  # no gradient buffer for the frozen base
    assert single["state_params"] == 8 * 2  # Adam state for A and B of 8 adapters, nothing else
    assert all(g.abs().sum() > 0 for g in single["grads"].values())


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                                    ["parallel.pp=2"], ["parallel.seed=1234"], ["optim.distributed_optimizer=true"]],
                         ids=["tp2", "tp2-sp", "pp2", "dp2", "dp2-distopt"])
def test_adapter_gradients_match_one_process(hf_dir, single, tmp_path, layout):
    split = _step(tmp_path, hf_dir, 2, *layout)
    assert sorted(split["grads"]) == sorted(single["grads"])
    assert split["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-5)
    for name, grad in single["grads"].items():
        if "distributed_optimizer" not in layout[0]:  # its buffers hold each rank's reduced shard only
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
        torch.testing.assert_close(split["values"][name], single["values"][name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return str(save_hf_model(tiny_hf_config("qwen3_moe", layers=2), tmp_path_factory.mktemp("lora_moe") / "m"))


@pytest.mark.multiproc
@pytest.mark.slow
def test_moe_attention_adapters_match_one_process_at_tp2_and_ep2(moe_dir, tmp_path):
    """Qwen3-MoE: adapters on the attention only (lora.targets=null); at TP2 (sequence parallel) and EP2 the experts
    stay frozen and the adapters' gradients are one process's. No load-balancing loss: its gradient reaches the
    attention through the router, and at EP2 (data parallel) each rank balances its own tokens, not the step's."""
    no_aux = "model.moe_aux_loss_coef=0"
    single = _step(tmp_path, moe_dir, 1, no_aux)
    assert {name.split(".")[1] for name in single["grads"]} == {"linear_qkv", "linear_proj"}
    for layout in (["parallel.tp=2"], ["parallel.ep=2"]):
        split = _step(tmp_path, moe_dir, 2, *layout, no_aux)
        assert split["metrics"]["loss"] == pytest.approx(single["metrics"]["loss"], rel=1e-5)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=f"{layout} {name}")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2"]], ids=["tp2"])
def test_a_resumed_lora_run_takes_the_next_step_exactly(hf_dir, tmp_path, layout):
    """kill -9 after a checkpoint, resumed: the adapters and their Adam moments come back from the dist checkpoint
    (the base from model.hf_path), and the next step is bit-identical."""
    nproc = 2 if layout else 1
    first = tmp_path / "first.pt"
    run_torchrun(WORKER, nproc, [str(first), hf_dir, *layout])
    (checkpoint,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    proc = run_torchrun(WORKER, nproc, [str(tmp_path / "again.pt"), hf_dir, "resume", str(checkpoint),
                                        str(first.with_suffix(".second.pt")), *layout])
    assert "RESUMED EXACTLY" in proc.stdout, proc.stdout[-3000:]
