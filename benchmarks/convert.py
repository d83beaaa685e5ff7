"""Benchmark: HF -> megatron dist checkpoint -> HF on the real Qwen2.5-0.5B shapes (random weights), one process each.

Reports seconds, GB/s against a plain ``safetensors.save_file`` of the same tensors (already in memory) measured in
the same run (goal >= 0.7x), and each step's peak RSS measured in a fresh process (goal <= 1.5x the model's
bytes; the RSS includes the interpreter with torch imported, shown in its own column).

Usage: python benchmarks/convert.py [--config DIR] [--dtype float32] [--workdir DIR] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "megatron_offgrpo" / "assets" / "qwen2.5-0.5b-config"


def _step(kind: str, args: list[str]) -> dict:
    """Run one step in a fresh interpreter; return its wall seconds and peak RSS.

    The disk is synced first so that no step pays for an earlier one's dirty pages, and every step ends with its
    data on disk (fsync): the conversions fsync for crash safety, so the plain save is fsync'd too.
    """
    os.sync()
    code = (
        "import json,sys,time\n"
        "import torch\n"
        "from safetensors.torch import save_file\n"
        "import checkpoint_tools as ct\n"
        "from checkpoint_tools import hf_to_megatron, megatron_to_hf\n"
        "def hwm():\n"
        "    return int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])*1024\n"
        "base=hwm()\n"
        "kind,a=sys.argv[1],sys.argv[2:]\n"
        "t=time.perf_counter()\n"
        "if kind=='plain':\n"
        "    src=ct.open_safetensors_dir(__import__('pathlib').Path(a[0]))\n"
        "    tensors={n:src[n] for n in src.names()}\n"
        "    t=time.perf_counter()\n"
        "    save_file(tensors,a[1]+'/model.safetensors',metadata={'format':'pt'})\n"
        "    fd=__import__('os').open(a[1]+'/model.safetensors',0); __import__('os').fsync(fd)\n"
        "elif kind=='to_megatron':\n"
        "    hf_to_megatron.main(['--hf',a[0],'--out',a[1]])\n"
        "else:\n"
        "    megatron_to_hf.main(['--ckpt',a[0],'--out',a[1]])\n"
        "dt=time.perf_counter()-t\n"
        "print(json.dumps({'seconds':dt,'peak_rss':hwm(),'base_rss':base}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, kind, *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="HF config directory (shapes)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per step; the median is reported")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="offgrpo-convert-", dir=args.workdir))
    try:
        hf = work / "hf"
        from checkpoint_tools.roundtrip import make_random_hf

        nbytes = make_random_hf(args.config, hf, getattr(torch, args.dtype))
        rows = {"plain safetensors save": [], "HF -> megatron dist checkpoint": [], "megatron dist -> HF": []}
        names = list(rows)
        for r in range(args.repeats):
            plain, mega, back = work / f"plain{r}", work / f"mega{r}", work / f"back{r}"
            plain.mkdir()
            rows[names[0]].append(_step("plain", [str(hf), str(plain)]))
            rows[names[1]].append(_step("to_megatron", [str(hf), str(mega)]))
            rows[names[2]].append(_step("to_hf", [str(mega), str(back)]))
            for d in (plain, mega, back):
                shutil.rmtree(d)
        base_s = statistics.median(x["seconds"] for x in rows[names[0]])
        print(f"\nQwen2.5-0.5B shapes, {args.dtype}, model {nbytes / 1e9:.2f} GB, {os.cpu_count()} cores, "
              f"median of {args.repeats}\n")
        print("| step | seconds | GB/s | vs plain save | peak RSS (GB) | peak RSS / model bytes "
              "| interpreter RSS (GB) |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            secs = statistics.median(x["seconds"] for x in rows[name])
            rss = max(x["peak_rss"] for x in rows[name])
            print(f"| {name} | {secs:.2f} | {nbytes / secs / 1e9:.2f} | {base_s / secs:.2f}x | {rss / 1e9:.2f} | "
                  f"{rss / nbytes:.2f} | {max(x['base_rss'] for x in rows[name]) / 1e9:.2f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
