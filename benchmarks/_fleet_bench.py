"""What the fleet refresh benchmarks share (``refresh.py``, ``lora_refresh.py``): random-weight HF directories of
the model shapes, the megatron forward of the probe, the perturbation
that makes every refresh carry visibly new weights, and the bucketed transports."""

from __future__ import annotations

import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN05 = REPO / "megatron_offgrpo" / "assets" / "qwen2.5-0.5b-config"
DEMO_TINY = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"
TINY = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=4096, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            hidden_act="silu", rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=512,
            tie_word_embeddings=False, initializer_range=0.2)
"""The tests' tiny Qwen2 (a 4,096-token vocabulary)."""


def config_of(source: dict | Path, layers: int | None = None) -> dict:
    """A HF config: ``source`` itself or a directory's ``config.json``, with ``layers`` decoder layers if given."""
    cfg = dict(source) if isinstance(source, dict) else json.loads((Path(source) / "config.json").read_text())
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def random_model_dir(cfg: dict, out: Path) -> Path:
    """A random-weight HF directory of the model of ``cfg`` (float32, version 0 in its manifest)."""
    import torch

    from checkpoint_tools import hf_shapes
    from megatron_offgrpo.model import arch_from_hf_config, hf_config_dict
    from megatron_offgrpo.transports import weights_dir

    arch = arch_from_hf_config(cfg)
    config = hf_config_dict(arch, cfg)
    config["torch_dtype"] = "float32"
    gen = torch.Generator().manual_seed(0)
    std = arch.initializer_range

    def buckets():
        for hf_name, shape in hf_shapes(arch).items():
            tensor = torch.randn(shape, generator=gen) * std
            yield [(hf_name, 1.0 + tensor if hf_name.endswith("norm.weight") else tensor)]

    weights_dir.write_version_dir(out, buckets(), 0, hf_config=config, overwrite=True)
    return out


def probe_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) under a one-process megatron stage (no gradients)."""
    import torch

    with torch.no_grad():
        tokens = torch.tensor([ids])
        logits = model(tokens, torch.arange(len(ids)).unsqueeze(0), None)
        return logits[0, :-1].float().log_softmax(-1).gather(-1, tokens[0, 1:, None])[:, 0].tolist()


def perturb(params, scale: float = 0.02) -> None:
    """Move each parameter by ``scale`` x its std (untimed): each refresh then carries visibly new weights, so a
    stale tensor on the fleet would fail the probe."""
    import torch

    with torch.no_grad():
        for param in params:
            param.add_(torch.randn_like(param), alpha=scale * float(param.float().std().clamp_min(1e-3)))


def bucketed_transport(kind: str, workdir: Path, bucket_bytes: int):
    """The product's transport ``kind`` (disk, collective or shm) with ``bucket_bytes`` buckets."""
    from megatron_offgrpo.transports import CollectiveTransport, DiskTransport, SharedMemoryTransport

    if kind == "disk":
        return DiskTransport(workdir / "shared", keep=1, bucket_bytes=bucket_bytes)
    if kind == "shm":
        return SharedMemoryTransport(bucket_bytes=bucket_bytes, timeout_s=600)
    if kind == "collective":
        return CollectiveTransport(bucket_bytes=bucket_bytes, timeout_s=600)
    raise ValueError(f"transport {kind!r}: choose from disk, collective, shm")


def timed_start(spec, state_dir: Path, timeout_s: float = 900) -> float:
    """Start the fleet of ``spec`` at ``state_dir`` (waiting until it is healthy); returns the seconds it took."""
    from megatron_offgrpo.fleet import start_fleet

    start = time.perf_counter()
    start_fleet(spec, state_dir, timeout_s=timeout_s)
    return time.perf_counter() - start
