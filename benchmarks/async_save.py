"""Benchmark: how long a checkpoint blocks training, synchronous vs ``train.async_save``, at the Qwen2.5-0.5B shape
(random weights, one process, the trainer's own ``save_checkpoint`` of the megatron model and its Adam state).

Per save, medians of ``--repeats``: the seconds ``save_checkpoint`` holds the trainer (sync: the whole write and
fsync; async: the plan, the small files, the host copies of the tensors and the fork of the writer), the extra
seconds of the optimizer step right after it over one with no save in flight (the first write to each page a
writer's fork shared, and the writer's share of the cores), their sum (the step's blocked time per save), and the
seconds from the save's start until the checkpoint is published (async: written in the background while the step
runs). The step here is the optimizer step alone (Adam over every parameter, on fixed random gradients): the part of
a training step that changes what is saved.

Usage: python benchmarks/async_save.py [--config DIR] [--precision fp32] [--repeats 3] [--workdir DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_CONFIG = REPO / "megatron_offgrpo" / "assets" / "qwen2.5-0.5b-config"

from benchmarks._tables import write_table  # noqa: E402

COLUMNS = ["save", "save call blocks (s)", "next step's extra (s)", "step blocked per save (s)",
           "until published (s)", "checkpoint (GB)"]


def _policy(config_dir: Path, precision: str):
    """The trainer's policy at ``config_dir``'s shape (random weights) with random gradients in its buffers."""
    import torch

    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.runtime import init_parallel, tune_cpu_memory
    from megatron_offgrpo.train import build_policy

    tune_cpu_memory()
    ctx = init_parallel(1, 1, 1234)
    arch = load_arch(config_dir)
    policy = build_policy(arch, ctx, ModelConfig(hf_path=str(config_dir), init="random", precision=precision),
                          OptimConfig(lr=1e-6, min_lr=1e-6), steps=1000)
    gen = torch.Generator().manual_seed(0)
    for param in policy.model.parameters():
        param.main_grad.copy_(torch.randn(param.shape, generator=gen) * 1e-3)
    policy.optimizer.step()  # Adam's state exists (and is saved) from here on
    return policy, ctx


def _step(policy) -> float:
    from megatron_offgrpo.runtime import release_free_memory

    start = time.perf_counter()
    policy.optimizer.step()
    release_free_memory()  # as the trainer does after each optimizer step
    return time.perf_counter() - start


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _measure(policy, ctx, run_dir: Path, background, config_dir: Path, repeats: int) -> list[dict]:
    """``repeats`` saves (each after a step), each followed by the next step and the wait for its publication."""
    from checkpoint_tools import dist_ckpt
    from megatron_offgrpo.train import checkpoint

    card = dist_ckpt.DistModelCard(json.loads((config_dir / "config.json").read_text()),
                                   str(next(policy.model.parameters()).dtype).removeprefix("torch."), ctx.layout())
    rows = []
    for i in range(repeats):
        quiet = statistics.median(_step(policy) for _ in range(2))  # a step with no save in flight
        state = checkpoint.TrainerState(step=i + 1, version=0, scheduler=policy.scheduler.state_dict())
        start = time.perf_counter()
        final = checkpoint.save_checkpoint(run_dir, policy.model, policy.optimizer, state, keep=1, card=card,
                                           background=background)
        call = time.perf_counter() - start
        after = _step(policy)
        if background is not None:
            background.finish("the benchmark")
        published = time.perf_counter() - start if background is not None else call
        rows.append({"call": call, "extra": max(after - quiet, 0.0), "published": published, "bytes": _bytes(final)})
        print(f"{'async' if background else 'sync'} save {i + 1}: call {call:.2f} s, next step {after:.2f} s "
              f"(quiet {quiet:.2f} s), published after {published:.2f} s", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="HF config directory (shapes)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="model.precision")
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode; medians are reported")
    parser.add_argument("--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-async-save", help="table and JSON")
    args = parser.parse_args()
    from megatron_offgrpo.runtime import BackgroundSave

    policy, ctx = _policy(args.config, args.precision)
    work = Path(tempfile.mkdtemp(prefix="offgrpo-async-save-", dir=args.workdir))
    try:
        table = []
        for name, background in (("sync", None), ("async (train.async_save)", BackgroundSave(ctx.device))):
            rows = _measure(policy, ctx, work / name.split()[0], background, args.config, args.repeats)
            shutil.rmtree(work / name.split()[0])
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            table.append({COLUMNS[0]: name, COLUMNS[1]: f"{med['call']:.2f}", COLUMNS[2]: f"{med['extra']:.2f}",
                          COLUMNS[3]: f"{med['call'] + med['extra']:.2f}", COLUMNS[4]: f"{med['published']:.2f}",
                          COLUMNS[5]: f"{med['bytes'] / 1e9:.2f}"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(args.out, "async_save", COLUMNS, table)


if __name__ == "__main__":
    main()
