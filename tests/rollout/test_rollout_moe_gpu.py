"""vLLM's own routed-experts output (``enable_return_routed_experts``, its Model Runner V2 on a GPU): the in-process
engine and a one-server fleet started with ``--record-routing`` give each sample the routing vLLM returned with its
answer, equal to a fp32 HF forward's, with prefix caching on (a group's samples share their prompt's cached blocks) and
after a refresh.

CPU twins of the same logic: ``test_rollout_moe.py`` (the CPU workers' hooks, the same HF comparison),
``test_rollout_wire.py`` (the answer's wire format decoded) and ``test_rollout_launcher.py`` (the servers' flags read
by vLLM's own parser).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: vLLM returns routed experts from its GPU model runner only; the CPU twins run the hooks",
    ),
]
pytest.importorskip("vllm", reason="needs vLLM")

from megatron_offgrpo.fleet import FleetSpec, start_fleet, stop_fleet  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine  # noqa: E402
from megatron_offgrpo.transports import DiskTransport  # noqa: E402
from tests.helpers import save_hf_model  # noqa: E402
from tests.rollout import scenarios  # noqa: E402
from tests.rollout.tiny import TINY_MOE, as_buckets, hf_weights, perturbed, routing_mismatches  # noqa: E402

TOKEN = "rollout-moe-gpu-token"


def _generate(engine) -> list:
    """Sampled groups of 3 (one prompt's cached blocks shared by its group) and a greedy group."""
    return engine.generate(scenarios.PROMPTS, 3, scenarios.SAMPLED) + engine.generate(
        scenarios.PROMPTS[:1], 2, scenarios.GREEDY
    )


def _assert_hf_routing(model_dir, weights, samples) -> None:
    for sample in samples:
        assert sample.routed_experts.shape == (len(sample.prompt_ids) + len(sample.response_ids) - 1,
                                               TINY_MOE["num_hidden_layers"], TINY_MOE["num_experts_per_tok"])
    differ, total = routing_mismatches(model_dir, weights, samples)
    # fp32 on both sides; cuBLAS sums in another order than the CPU, so a near tie may flip on a rare position
    assert differ <= total // 100, f"{differ} of {total} positions x layers routed unlike HF"


def test_in_process_engine_returns_vllms_routing(tmp_path):
    from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

    model_dir = save_hf_model(dict(TINY_MOE), tmp_path / "tiny-moe", seed=13)
    weights = perturbed(hf_weights(model_dir), 91)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512, max_num_seqs=16, record_routing=True,
                        enforce_eager=False)
    try:
        assert engine._routing_source == "vllm"  # vLLM's output, not the CPU hooks (graphs and prefix caching on)
        before = _generate(engine)
        engine.update_weights(as_buckets(weights), 1)
        after = _generate(engine)
    finally:
        engine.close()
    _assert_hf_routing(model_dir, None, before)
    _assert_hf_routing(model_dir, weights, after)


def test_fleet_returns_vllms_routing(tmp_path):
    model_dir = save_hf_model(dict(TINY_MOE), tmp_path / "tiny-moe", seed=13)
    weights = perturbed(hf_weights(model_dir), 92)
    spec = FleetSpec(model_dir=model_dir, num_servers=1, token=TOKEN, dtype="float32", max_model_len=512,
                     record_routing=True, enforce_eager=False)
    try:
        start_fleet(spec, tmp_path / "state", wait=True, timeout_s=600)
        engine = FleetEngine.from_state(tmp_path / "state", DiskTransport(tmp_path / "w"), record_routing=True)
        try:
            assert set(engine._routing_sources.values()) == {"vllm"}
            before = _generate(engine)
            engine.update_weights(as_buckets(weights), engine.version() + 1)
            after = _generate(engine)
        finally:
            engine.close()
    finally:
        stop_fleet(tmp_path / "state" / "fleet.json")
    _assert_hf_routing(model_dir, None, before)
    _assert_hf_routing(model_dir, weights, after)
