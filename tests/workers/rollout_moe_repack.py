"""vLLM CPU's MoE reload bug and the worker extension's repack, on the in-process ``VLLMEngine`` serving the tiny
Qwen3-MoE (a subprocess: vLLM's CPU worker patches process-wide torch settings).

Usage: python rollout_moe_repack.py WORK_DIR     (exit status 0 and a last line "OK ..." on success)
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EXACT = 3e-5  # fp32 vLLM vs fp32 HF: a fresh load measures 7e-6 (std-0.2 init: log-probs of -10 to -20)


def _error(engine, probe, expected) -> float:
    got = next(iter(engine.probe_logprobs(probe).values())).logprobs
    return max(abs(a - b) for a, b in zip(got, expected))


def check_reload_and_repack(work: Path) -> str:
    """A plain reload leaves the experts unpacked (the probe is off by nats); the repack detects that per layer and
    restores exactness; a second repack finds them packed and leaves them; a layout it does not know fails."""
    import pytest

    from megatron_offgrpo.fleet._moe_repack import MoeLayoutError, repack_after_reload
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from tests.helpers import save_hf_model
    from tests.rollout.tiny import TINY_MOE, as_buckets, hf_probe_logprobs, hf_weights, perturbed

    model_dir = save_hf_model(dict(TINY_MOE), work / "moe", seed=11)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512)
    probe = probes.make_probe_ids(TINY_MOE["vocab_size"], 24)
    base = hf_weights(model_dir)
    fresh = _error(engine, probe, hf_probe_logprobs(model_dir, None, probe))
    assert fresh < EXACT, fresh

    new = perturbed(base, 81)
    expected = hf_probe_logprobs(model_dir, new, probe)

    def plain_reload(worker):  # what the extension did before the repack: vLLM's reload alone
        worker.reload_weights(weights_iterator=iter(list(new.items())), is_checkpoint_format=True)

    def repack(worker, tensors=new):
        return repack_after_reload(worker.model_runner.get_model(), tensors)

    engine.llm.collective_rpc(plain_reload)
    engine.llm.reset_prefix_cache()
    unpacked = _error(engine, probe, expected)
    [first] = engine.llm.collective_rpc(repack)
    assert first == 2, f"the repack found {first} of 2 layers unpacked: this vLLM packs MoE experts on reload itself"
    assert unpacked > 0.1, f"a plain reload is exact ({unpacked:.2e}) though the detection found unpacked experts"
    engine.llm.reset_prefix_cache()
    repacked = _error(engine, probe, expected)
    assert repacked < EXACT, repacked
    assert engine.llm.collective_rpc(repack) == [0]  # packed already: a vLLM that packs itself is not packed twice
    engine.llm.reset_prefix_cache()
    assert _error(engine, probe, expected) < EXACT
    with pytest.raises(MoeLayoutError, match=r"^layer 0: .*neither in checkpoint layout nor in vLLM's prepacked"):
        engine.llm.collective_rpc(lambda worker: repack(worker, perturbed(base, 82)))  # weights not the loaded ones

    # the extension's own refreshes: in memory and from a version directory, each verified by the probe
    version_two = perturbed(base, 83)
    report = engine.update_weights(as_buckets(version_two), 1)
    assert report.detail["moe_repack_s"] >= 0.0, report.detail
    probes.verify_refresh(engine, probe, hf_probe_logprobs(model_dir, version_two, probe), 1, EXACT)
    from megatron_offgrpo.transports import calls, weights_dir

    version_three = perturbed(base, 84)
    path, _ = weights_dir.write_version_dir(work / "v3", as_buckets(version_three), 2, hf_config=dict(TINY_MOE))
    report = engine.update_weights(path, 2)
    probes.verify_refresh(engine, probe, hf_probe_logprobs(model_dir, version_three, probe), 2, EXACT)
    answer = engine._rpc(calls.Info())
    assert answer.ok and answer.version == 2
    engine.close()
    del engine
    gc.collect()
    return f"fresh {fresh:.1e} unpacked {unpacked:.3f} repacked {repacked:.1e}"


def check_padded_refused(work: Path) -> None:
    """vLLM CPU pads a MoE intermediate size that is not a multiple of 32; its in-place reload cannot copy unpadded
    weights back: the worker refuses such a refresh before loading anything and keeps serving."""
    import pytest

    from megatron_offgrpo.rollout import VLLMEngine, errors, probes
    from tests.helpers import save_hf_model
    from tests.rollout.tiny import TINY_MOE, as_buckets, hf_weights, perturbed

    model_dir = save_hf_model(dict(TINY_MOE, moe_intermediate_size=48), work / "padded", seed=12)
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512)
    probe = probes.make_probe_ids(TINY_MOE["vocab_size"], 16)
    before = next(iter(engine.probe_logprobs(probe).values())).logprobs
    with pytest.raises(errors.RefreshError, match="pads the MoE intermediate size 48 to 64"):
        engine.update_weights(as_buckets(perturbed(hf_weights(model_dir), 85)), 1)
    assert engine.version() == 0 and next(iter(engine.probe_logprobs(probe).values())).logprobs == before
    engine.close()


def check_bf16(work: Path) -> None:
    """Served in bf16 from fp32 tensors: the layout check compares with the tensors cast as the loader casts them, and
    the refreshed engine's probe is bit-identical to a fresh bf16 engine's on the same weights."""
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from megatron_offgrpo.transports import weights_dir
    from tests.rollout.tiny import TINY_MOE, as_buckets, hf_weights, perturbed

    model_dir = work / "moe"  # check_reload_and_repack's model
    probe = probes.make_probe_ids(TINY_MOE["vocab_size"], 24)
    new = perturbed(hf_weights(model_dir), 86)
    path, _ = weights_dir.write_version_dir(work / "bf16", as_buckets(new), 1, hf_config=dict(TINY_MOE))
    engine = VLLMEngine(path, dtype="bfloat16", max_model_len=512)
    fresh = next(iter(engine.probe_logprobs(probe).values())).logprobs
    engine.close()
    del engine
    gc.collect()
    engine = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=512)
    report = engine.update_weights(as_buckets(new), 1)
    assert "moe_repack_s" in report.detail, report.detail
    refreshed = next(iter(engine.probe_logprobs(probe).values())).logprobs
    assert refreshed == fresh, max(abs(a - b) for a, b in zip(refreshed, fresh))
    engine.close()


def main() -> None:
    work = Path(sys.argv[1])
    numbers = check_reload_and_repack(work)
    check_padded_refused(work)
    check_bf16(work)
    print(f"OK {numbers}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
