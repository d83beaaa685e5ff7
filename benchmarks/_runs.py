"""What the benchmarks that run ``offgrpo`` share: the command, a run's per-step records, a random tiny model, a
one-server fleet for the length of a block."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"


def offgrpo(*args: str) -> None:
    """``offgrpo ARGS`` from the repository root, its console output dropped (its logs stay in the run directory)."""
    subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", *args], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)


def run_records(run_dir: Path) -> list[dict]:
    """A run's ``metrics.jsonl``, one dict per step."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def random_model(directory: Path, seed: int = 0, **config: object) -> Path:
    """The tiny model with random weights (its config changed by ``config``) as a HF directory, made once: a fleet
    serves weights from disk, and the trainer starts from the same ones."""
    if not (directory / "config.json").exists():
        import torch
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(TINY, **config)
        torch.manual_seed(seed)
        transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(directory)
    return directory


@contextlib.contextmanager
def one_server_fleet(model: Path, state: Path, wanted: bool = True) -> Iterator[Path]:
    """A one-server fp32 fleet of ``model`` (``offgrpo fleet start``, a new token) whose state dir is ``state``, for
    the block, stopped after it even when the block fails; when not ``wanted`` (no variant uses it), none."""
    if wanted:
        offgrpo("fleet", "start", "--model", str(model), "--num-servers", "1", "--dtype", "float32",
                "--max-model-len", "512", "--new-token", "--state-dir", str(state))
    try:
        yield state
    finally:
        if (state / "fleet.json").exists():
            offgrpo("fleet", "stop", "--state-dir", str(state))
