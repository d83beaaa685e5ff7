"""Delta refreshes (``rollout.sync=delta``) on the in-process ``VLLMEngine`` (a subprocess: vLLM's CPU worker patches
process-wide torch settings): a full sync first, then deltas that score the probe as an HF forward of the same
weights does, and every fault (a flipped byte, a missing tensor, a wrong base, an engine without an image) ending in
the same version sent whole, verified.

Usage: python rollout_vllm_delta.py MODEL_DIR     (exit status 0 and a last line "OK ..." on success)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ATOL = 1e-4  # fp32 engine against an fp32 HF forward of the same weights (measured ~1e-5)


def step(weights: dict, frac: float, seed: int) -> dict:
    """An optimizer step's shape: ``frac`` of every tensor's elements moved a little."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[name] = torch.where(mask, t + 0.05 * torch.randn(t.shape, generator=g), t)
    return out


def refresh(engine, sender, weights: dict, version: int, model_dir: Path, probe: list[int], fault=None):
    """Send ``weights`` as ``version`` through ``sender`` (``fault`` may spoil the payload first), check the probe."""
    from megatron_offgrpo.rollout import probes
    from tests.rollout.tiny import as_buckets, hf_probe_logprobs

    payload, reason = sender.payload(as_buckets(weights), version)
    if fault is not None:
        fault(payload)
    report = engine.update_weights(payload, version)
    probes.verify_refresh(engine, probe, hf_probe_logprobs(model_dir, weights, probe), version, ATOL)
    sender.pushed(version, full=report.kind != "delta", refused=report.full_sync)
    return report, reason


def flip_byte(payload) -> None:
    blob = payload.buckets[0][0][1]
    blob[-1] ^= 0x01  # the last byte of the first tensor's blob (a value, or the zlib trailer)


def drop_tensor(payload) -> None:
    payload.buckets[0].pop(0)


def wrong_base(payload) -> None:
    from megatron_offgrpo.transports import deltas

    payload.spec = deltas.DeltaSpec(payload.spec.base - 1, payload.spec.dtype)


def main() -> None:
    import torch

    from megatron_offgrpo.rollout import VLLMEngine, probes
    from megatron_offgrpo.train import DeltaSender
    from tests.rollout.tiny import TINY, as_buckets, hf_weights

    model_dir = Path(sys.argv[1])
    probe = probes.make_probe_ids(TINY["vocab_size"], 24)
    start = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512)
    sender = DeltaSender(torch.float32, full_every=100, bucket_bytes=1 << 20)
    weights = hf_weights(model_dir)
    weights = step(weights, 0.5, 1)
    report, reason = refresh(engine, sender, weights, 1, model_dir, probe)
    assert report.kind == "full" and reason == "first", (report, reason)
    full_bytes = report.bytes
    for version, frac in ((2, 0.01), (3, 0.0), (4, 0.2)):
        weights = step(weights, frac, version)
        report, reason = refresh(engine, sender, weights, version, model_dir, probe)
        assert report.kind == "delta" and reason is None and not report.full_sync, report
        fraction = report.detail["changed_fraction"]
        assert abs(fraction - frac) < 0.02, (frac, report.detail)
        print(f"v{version}: {100 * fraction:.2f}% changed, {report.bytes} B of {full_bytes} B, {report.seconds:.3f} s")
    assert report.bytes < full_bytes
    for version, fault, why in ((5, flip_byte, "refused: "), (6, drop_tensor, "refused: tensors"),
                               (7, wrong_base, "refused: base")):
        weights = step(weights, 0.01, version)
        report, _ = refresh(engine, sender, weights, version, model_dir, probe, fault)
        assert report.kind == "full" and report.full_sync[engine.name].startswith(why), report.full_sync
        assert report.full_sync[engine.name] != "refused: failed", report.full_sync
        print(f"v{version}: {fault.__name__} -> full sync ({report.full_sync[engine.name]})")
    # an install that is not delta-mode (as after a restart or a join, the worker has no image): the delta is refused
    weights = step(weights, 0.01, 8)
    engine.update_weights(as_buckets(weights), 8)
    sender.pushed(8, full=False, refused={})
    weights = step(weights, 0.01, 9)
    report, _ = refresh(engine, sender, weights, 9, model_dir, probe)
    assert report.kind == "full" and report.full_sync[engine.name] == "refused: no image", report.full_sync
    weights = step(weights, 0.01, 10)
    report, _ = refresh(engine, sender, weights, 10, model_dir, probe)
    assert report.kind == "delta", report
    nan = dict(weights)
    nan[next(iter(nan))] = torch.full_like(next(iter(nan.values())), float("nan"))
    try:
        sender.payload(as_buckets(nan), 11)
    except ValueError as exc:
        assert "NaN" in str(exc)
    else:
        raise AssertionError("a NaN weight was encoded")
    engine.close()
    print(f"OK in-process vLLM engine, delta refreshes: all cases passed ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)
