"""The conversion round trip on the embedded default: random weights with real Qwen2.5-0.5B shapes and the real
Qwen tokenizer, HF -> megatron dist checkpoint -> HF, verified bit-exact and loadable by transformers.

One process: a dist checkpoint loads at any layout, so the round trip needs no other (``torchrun`` writes one at a
TP x PP x EP of several processes: ``checkpoint_tools.hf_to_megatron``; ``tests/checkpoint/test_megatron_format.py``
loads one written at TP2 into a PP2 trainer).

Usage: python -m checkpoint_tools.roundtrip [--config DIR] [--dtype bfloat16] [--workdir runs/roundtrip]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from checkpoint_tools._cli import run_cli
from checkpoint_tools._dist import dist_checkpoint_to_hf_dir
from checkpoint_tools._dist_write import hf_to_dist_dir
from checkpoint_tools._io import open_safetensors_dir
from checkpoint_tools._safetensors_stream import StreamingSafetensorsWriter
from checkpoint_tools._shapes import hf_shapes
from megatron_offgrpo.model import load_arch

ASSETS = Path(__file__).resolve().parents[1] / "megatron_offgrpo" / "assets"
DEFAULT_CONFIG = ASSETS / "qwen2.5-0.5b-config"
TOKENIZER = ASSETS / "qwen2-tokenizer"
logger = logging.getLogger(__name__)


def make_random_hf(config_dir: Path, out: Path, dtype: torch.dtype, seed: int = 0) -> int:
    """Write a HF directory with ``config_dir``'s shapes, random weights (std 0.02) and the Qwen tokenizer.

    Streams one tensor at a time. Returns the weights' bytes.
    """
    arch = load_arch(config_dir)
    gen = torch.Generator().manual_seed(seed)
    shapes = hf_shapes(arch)
    out.mkdir(parents=True)
    writer = StreamingSafetensorsWriter(out / "model.safetensors", [(n, dtype, s) for n, s in shapes.items()])
    for name, shape in shapes.items():
        writer.write(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    writer.close()
    cfg = json.loads((config_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=str(dtype).removeprefix("torch."))))
    for src in [config_dir / "generation_config.json", *TOKENIZER.glob("*.json"), *TOKENIZER.glob("*.txt")]:
        if src.is_file():
            shutil.copy(src, out / src.name)
    return sum(torch.Size(s).numel() for s in shapes.values()) * torch.empty((), dtype=dtype).element_size()


def run(args: argparse.Namespace) -> None:
    """Make the source, convert, reshard, export, verify; print where everything is."""
    import transformers

    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    dtype = getattr(torch, args.dtype)
    timings = {}
    start = time.perf_counter()
    nbytes = make_random_hf(Path(args.config), work / "hf_source", dtype)
    timings["make random HF source"] = time.perf_counter() - start
    steps = [
        ("HF -> megatron dist checkpoint", lambda: hf_to_dist_dir(work / "hf_source", work / "megatron")),
        ("megatron -> HF",
         lambda: dist_checkpoint_to_hf_dir(work / "megatron", work / "hf_export", max_shard_bytes=500 * 1024**2)),
    ]
    for name, step in steps:
        start = time.perf_counter()
        step()
        timings[name] = time.perf_counter() - start
        logger.info("%s: %.2f s", name, timings[name])
    source, export = open_safetensors_dir(work / "hf_source"), open_safetensors_dir(work / "hf_export")
    if set(source.names()) != set(export.names()):
        raise ValueError("round trip changed the tensor names: "
                         f"{sorted(set(source.names()) ^ set(export.names()))[:5]}")
    different = [n for n in source.names() if not torch.equal(source[n], export[n])]
    if different:
        raise ValueError(f"round trip is not bit-exact for {len(different)} tensors, e.g. {different[:3]}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf_export")
    model = transformers.AutoModelForCausalLM.from_pretrained(work / "hf_export", dtype=dtype)
    print(f"\nround trip OK: {len(source.names())} tensors, {nbytes / 1e9:.2f} GB, bit-exact; "
          f"transformers loaded {type(model).__name__} "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params) "
          f"and a {len(tokenizer)}-token tokenizer")
    for name, secs in timings.items():
        print(f"  {name:32s} {secs:6.2f} s")
    print(f"outputs under {work}/: hf_source, megatron, hf_export")


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="HF config directory giving the shapes")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights dtype")
    parser.add_argument("--workdir", default="runs/roundtrip", help="where the 3 checkpoints go (replaced)")
    args = parser.parse_args(argv)
    run_cli(lambda: run(args))


if __name__ == "__main__":
    main()
