"""Everything a run needs, built once (the recipe's ``setup``): the trainer side on every rank; on rank 0 the run
directory, version 0 exported, the rollout side serving it, and the metrics log."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from megatron_offgrpo.config import Config
from megatron_offgrpo.model import resolve_model_dir
from megatron_offgrpo.runlog import MetricsLog, checkpoints, open_metrics_log, write_run_info
from megatron_offgrpo.sampler import RolloutSide
from megatron_offgrpo.train._checkpoint import sweep_partial_exports
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
        checkpoints.sweep_partial(run_dir)
        sweep_partial_exports(run_dir)
    v0 = trainer.export_hf(run_dir / "weights" / "v0")
    if not rank0:
        return trainer, None, None
    rollout = RolloutSide.build(config, v0, run_dir, trainer.arch.max_position_embeddings, trainer.engine_adapter())
    try:
        # once the engine (rollout.engine=auto's pick) is known
        write_run_info(run_dir, config, trainer.ctx, trainer.arch, started, rollout.engine, rollout.data_report)
        ctx = trainer.ctx
        logger.info("run %s: %s, tp=%d pp=%d dp=%d, engine %s, v=%d, %s", run_dir, trainer.arch.model_type,
                    ctx.tp_size, ctx.pp_size, ctx.dp_size, type(rollout.engine).__name__,
                    config.rollout.refresh_every, config.algo.objective)
        return trainer, rollout, open_metrics_log(config, rollout.maker.rollouts.tokenizer)
    except BaseException:  # the engine's threads end before the error does (a full disk, a tracker refused)
        rollout.close()
        raise

