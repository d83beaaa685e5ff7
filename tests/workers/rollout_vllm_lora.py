"""Adapter-only refreshes (``lora.sync=adapter``) on the in-process ``VLLMEngine`` (run as a subprocess, as
``rollout_vllm_engine.py`` is: vLLM's CPU worker patches process-wide torch settings).

Usage: python rollout_vllm_lora.py MODEL_DIR     (exit status 0 and a last line "OK ..." on success)
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ATOL = 1e-3  # the existing refresh checks' fp32 tolerance (measured: ~7e-6 for base + adapter against PEFT)


def check_swaps(engine, model_dir: Path, probe: list[int]) -> dict:
    """Version 0 is the base (all-zero adapter); each adapter version then scores the probe as PEFT's HF forward of
    base + adapter does, and the next version swaps it out. Returns the served version's adapter."""
    from megatron_offgrpo.rollout import probes
    from tests.rollout import lora
    from tests.rollout.tiny import hf_probe_logprobs

    probes.verify_refresh(engine, probe, hf_probe_logprobs(model_dir, None, probe), 0, ATOL)
    served = None
    for version, seed in ((1, 1), (2, 2)):
        served = lora.random_adapter(seed)
        report = engine.update_weights(lora.as_payload(served), version)
        assert report.kind == "adapter" and report.transport == "memory" and report.version == version, report
        assert report.tensors == len(served) and report.bytes == sum(t.numel() * 4 for t in served.values()), report
        expected = lora.peft_probe_logprobs(model_dir, served, probe)
        probes.verify_refresh(engine, probe, expected, version, ATOL)
        moved = max(abs(a - b) for a, b in zip(expected, hf_probe_logprobs(model_dir, None, probe)))
        assert moved > 0.5, f"adapter {version} moved the probe by {moved} only: too small to tell a swap"
    return served


def check_rejections(engine, model_dir: Path, probe: list[int], served: dict) -> None:
    """A bad adapter (a tensor missing, one of the wrong shape, NaN, a rank above the engine's, the wrong targets) and a
    whole model on an adapter engine are refused in one line per server naming the version still served; the previous
    adapter and version serve on (the probe still scores as PEFT's forward of it)."""
    import dataclasses

    import torch

    from megatron_offgrpo.rollout import errors, probes
    from megatron_offgrpo.transports import adapters
    from tests.rollout import lora
    from tests.rollout.tiny import as_buckets, hf_weights

    version, fresh = engine.version(), lora.random_adapter(9)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    wide = adapters.AdapterSpec(16, 32.0, adapters.TARGETS)
    bad = {
        "missing": (lora.SPEC, {n: t for n, t in fresh.items() if n != name}),
        "shape": (lora.SPEC, {**fresh, name: fresh[name].t().contiguous()}),
        "NaN": (lora.SPEC, {**fresh, name: torch.full_like(fresh[name], float("nan"))}),
        "rank": (wide, lora.random_adapter(9, wide)),
        "targets": (dataclasses.replace(lora.SPEC, target_modules=("q_proj",)), fresh),
    }
    expect = {"missing": "1 tensor(s) missing", "shape": "has shape [8, 128]", "NaN": "NaN or infinity",
              "rank": "exceeds the engine's max_lora_rank 8", "targets": "unknown tensor name"}
    for case, (spec, weights) in bad.items():
        try:
            engine.update_weights(lora.as_payload(weights, spec), version + 1)
        except errors.RefreshError as exc:
            reason = exc.failures[engine.name]
            assert "\n" not in reason and expect[case] in reason, (case, reason)
            assert f"version {version} still serves" in reason, (case, reason)
        else:
            raise AssertionError(f"the {case} adapter was installed")
        assert engine.version() == version
    try:
        engine.update_weights(as_buckets(hf_weights(model_dir)), version + 1)
    except errors.RefreshError as exc:
        assert "takes adapter refreshes, not whole models" in exc.failures[engine.name], exc
    else:
        raise AssertionError("a whole model was installed on an adapter engine")
    probes.verify_refresh(engine, probe, lora.peft_probe_logprobs(model_dir, served, probe), version, ATOL)


def check_rollback(engine, model_dir: Path, probe: list[int], served: dict) -> None:
    """An adapter that passes every check but fails while vLLM activates it (here: its first copy into the LoRA
    slot raises) is rolled back: the previous adapter is activated again and serves, the version unchanged."""
    from megatron_offgrpo.rollout import errors, probes
    from tests.rollout import lora

    def break_next_activation(worker) -> None:
        manager = worker.model_runner.lora_manager._adapter_manager
        original = manager.activate_adapter

        def once(lora_id):
            manager.activate_adapter = original  # the restore goes through
            raise RuntimeError("slot copy failed")

        manager.activate_adapter = once

    version = engine.version()
    engine._call(engine.llm.collective_rpc, break_next_activation)
    try:
        engine.update_weights(lora.as_payload(lora.random_adapter(11)), version + 1)
    except errors.RefreshError as exc:
        reason = exc.failures[engine.name]
        assert "failed to activate" in reason and f"version {version} still serves" in reason, reason
    else:
        raise AssertionError("a failed activation was reported as installed")
    assert engine.version() == version
    probes.verify_refresh(engine, probe, lora.peft_probe_logprobs(model_dir, served, probe), version, ATOL)
    after = lora.random_adapter(12)  # and the slot takes the next version
    engine.update_weights(lora.as_payload(after), version + 1)
    probes.verify_refresh(engine, probe, lora.peft_probe_logprobs(model_dir, after, probe), version + 1, ATOL)


def check_partial_rollouts(model_dir: Path, probe: list[int]) -> None:
    """``partial_rollouts`` across an adapter swap: each token carries the version whose adapter sampled it and its
    log-prob under that adapter (PEFT's forward), as across a full refresh (``scenarios.check_partial_refresh``)."""
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from tests.rollout import lora, scenarios

    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512, partial_rollouts=True, lora=lora.SPEC)

    def install(weights: dict, version: int) -> None:
        engine.update_weights(lora.as_payload(weights), version)
        probes.verify_refresh(engine, probe, lora.peft_probe_logprobs(model_dir, weights, probe), version, ATOL)

    scenarios.check_partial_refresh(engine, model_dir, lora.random_adapter(21), lora.random_adapter(22), install,
                                    model_of=lambda weights: lora.peft_model(model_dir, weights))
    engine.close()
    gc.collect()


def main() -> None:
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from tests.rollout import lora
    from tests.rollout.tiny import TINY

    model_dir = Path(sys.argv[1])
    probe = probes.make_probe_ids(TINY["vocab_size"], 24)
    start = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512, lora=lora.SPEC)
    served = check_swaps(engine, model_dir, probe)
    check_rejections(engine, model_dir, probe, served)
    check_rollback(engine, model_dir, probe, served)
    engine.close()
    del engine
    gc.collect()
    check_partial_rollouts(model_dir, probe)
    print(f"OK in-process vLLM engine, adapter refreshes: all cases passed ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
