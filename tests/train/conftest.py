"""Trainer test helpers: run `megatron_offgrpo.train` under torchrun (one rank: `offgrpo train`) on the tiny
Qwen-architecture model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, _free_port

TINY = [
    "model.hf_path=megatron_offgrpo/assets/tiny-qwen2", "model.init=random", "data.name=arithmetic",
    "data.count=200", "data.reward=tests.train.rewards:even_length", "rollout.engine=transformers",
    "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=8", "optim.lr=1e-3",
    "train.deterministic=true", "train.save_every=0",
]


def train_cmd(nproc: int, out_dir: Path, *overrides: str) -> list[str]:
    """The trainer on ``nproc`` ranks under torchrun; one rank is `offgrpo train` itself, the documented one-process
    command (torchrun's agent would add only its own start-up and a process to every such run)."""
    if nproc == 1:
        entry = ["-m", "megatron_offgrpo.cli", "train"]
    else:
        entry = ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
                 f"--master_port={_free_port()}", "-m", "megatron_offgrpo.train"]
    return [sys.executable, *entry, *TINY, f"train.out_dir={out_dir}", *overrides]


def train_env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")


def train_proc(nproc: int, out_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """A finished training run under torchrun (its output captured); raises with its stderr when it failed."""
    for _ in range(3):  # the free port may be taken by a parallel test's job before torchrun binds it: a new port
        proc = subprocess.run(train_cmd(nproc, out_dir, *overrides), cwd=REPO, env=train_env(), capture_output=True,
                              text=True, timeout=timeout)
        if proc.returncode == 0 or nproc == 1 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stderr[-8000:]}")
    return proc


def run_train(nproc: int, out_dir: Path, *overrides: str, timeout: float = 600) -> list[dict]:
    train_proc(nproc, out_dir, *overrides, timeout=timeout)
    return metrics(out_dir)


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. torchrun starts each worker in a session of its own, so killing
    torchrun's process group leaves the trainer running (it finishes the run): a crash test must kill the tree."""
    while True:
        children: dict[int, list[int]] = {}
        zombies = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # a process that just ended
            children.setdefault(int(ppid), []).append(int(stat.parent.name))
            if state == "Z":
                zombies.add(int(stat.parent.name))
        tree, stack = [], [pid]
        while stack:
            tree.append(stack.pop())
            stack.extend(children.get(tree[-1], []))
        live = [p for p in tree if p not in zombies]  # a zombie is dead already (its parent has not reaped it)
        if not live:
            return
        for p in live:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 asset with random weights (seed 0), as the HF directory a run exports as version 0: what an
    in-process rollout side serves."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2")
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny") / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out
