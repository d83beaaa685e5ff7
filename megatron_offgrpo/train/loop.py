"""The off-policy GRPO driver. The trainer side (every rank) and the rollout side (rank 0) exchange only samples
and weight buckets: every v steps the engine gets the current weights (verified on a probe), every step it
generates and scores a batch, the trainer learns from it. At the end the trained policy is written as a HF
directory (``out_dir/hf``; ``out_dir/exports/step_N`` every ``train.export_every``) and the run's summary
(``out_dir/summary.json``). SIGTERM / SIGINT stop it at the next step boundary with a checkpoint (``RunStopped``).
No formulas here.

    torchrun --nproc_per_node N -m megatron_offgrpo.train --config configs/tiny-cpu.yaml [key=value ...]
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from pathlib import Path

from megatron_offgrpo.config import Config, TrainConfig
from megatron_offgrpo.data import Sample
from megatron_offgrpo.envs import EnvironmentContractError, EnvironmentTimeout
from megatron_offgrpo.runlog import MetricsLog, checkpoints, finish_summary
from megatron_offgrpo.sampler import RolloutSide, sample_metrics
from megatron_offgrpo.train._checkpoint import load_rollout_state
from megatron_offgrpo.train._setup import setup
from megatron_offgrpo.train._stop import RunStopped, StopRequest
from megatron_offgrpo.train._sync import (GENERATION_FAILURES, StepRefresh, on_rank0_shared, refresh, share_samples,
                                          step_refresh, verify)
from megatron_offgrpo.train._trainer_side import TrainerSide

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a finished ``train`` hands back.

    Attributes:
        run_dir: the run directory (``train.out_dir``).
        summary: the end-of-run summary, as ``offgrpo train`` prints it, on the rank that logs (the rollout side);
            None on the others, so a job prints it once.
    """

    run_dir: Path
    summary: str | None


@dataclasses.dataclass
class StepTimes:
    """Where a step's seconds went, on the critical path (the ``time_*_s`` metrics; ``tokens_per_s`` is over their
    sum). Generation beside the trainer (overlap, async) counts only as the wait for its batch."""

    sync_s: float = 0.0  # installing and verifying the weights (0 without a refresh before the batch or after it)
    generate_s: float = 0.0  # rank 0: generating the batch, or waiting for it; 0 on the other ranks
    train_s: float = 0.0  # the optimizer step (trainer.learn)

    def metrics(self) -> dict[str, float]:
        return {"time_sync_s": self.sync_s, "time_generate_s": self.generate_s, "time_train_s": self.train_s}

    def total_s(self) -> float:
        return self.sync_s + self.generate_s + self.train_s


def train(config: Config) -> TrainResult:
    """Run (or resume) a training job. Collective over all torchrun ranks.

    Raises:
        RunStopped: SIGTERM or SIGINT arrived (on any rank): the run stopped at the next step boundary, every rank
            at the same one, after checkpointing it.
    """
    with StopRequest() as stop:
        return _train(config, stop)


def _train(config: Config, stop: StopRequest) -> TrainResult:
    trainer, rollout, log = setup(config)
    try:
        return _run(config, stop, trainer, rollout, log)
    except BaseException:
        if trainer.background is not None:  # no collective now: the other ranks may be gone
            trainer.background.abandon()
        _close_after_error(rollout, log)
        raise


def _close_after_error(rollout: RolloutSide | None, log: MetricsLog | None) -> None:
    """An error ends the run: stop and join what the rollout side and the trackers started (the async steps in
    flight, the engine's loop thread, a tracker's writer thread) before the error reaches the exit. A thread left
    running at interpreter exit inside the engine's native code aborted the process (``terminate called without an
    active exception``, exit 134) after the error's line. A failure to close is a warning: the error stays the one
    reported."""
    for what, part in (("the rollout side", rollout), ("the metrics log", log)):
        if part is None:  # ranks above 0 have neither
            continue
        try:
            part.close()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
            logger.warning("closing %s after the error failed (%s: %s)", what, type(exc).__name__, exc)


def _run(config: Config, stop: StopRequest, trainer: TrainerSide, rollout: RolloutSide | None,
         log: MetricsLog | None) -> TrainResult:
    steps, run_dir = config.train.steps, Path(config.train.out_dir)
    start, version = _start(trainer, rollout, log)  # the engine serves `version`, verified
    first_eval = _evaluate(rollout, version, "eval_start_") if start == 0 else {}  # what the run improves on
    nonfinite = 0
    for step in range(start, steps):
        stop.step = step
        if signum := stop.agreed(trainer.ctx.device):  # the boundary after step - 1: every rank agrees
            raise _stopped(trainer, rollout, log, signum, step, version, start)
        times, refreshes = StepTimes(), step_refresh(config, step, version)
        try:
            samples, version, sampling = _rollout(trainer, rollout, step, version, refreshes, times)
        except (EnvironmentTimeout, EnvironmentContractError) as exc:  # raised on every rank, before this step learns
            if signum := stop.agreed(trainer.ctx.device):  # a stop waited on it: still checkpoint the steps done
                logger.error("%s", exc)
                raise _stopped(trainer, rollout, log, signum, step, version, start) from None
            raise
        metrics = sample_metrics(samples, step, config.rollout.staleness_bound()) | sampling  # raises on stale ones
        learn_start = time.perf_counter()
        learned = trainer.learn(samples)
        times.train_s = time.perf_counter() - learn_start
        tokens = sum(s.trained_tokens() for s in samples)  # the model's: an episode's observations are not generated
        metrics |= learned.metrics | times.metrics() | {"policy_version": version,
                                                         "tokens_per_s": tokens / max(times.total_s(), 1e-9)}
        metrics |= trainer.refresh_metrics  # delta-mode refreshes: bytes, changed fraction, full syncs
        trainer.refresh_metrics = {}
        if step == start:
            metrics |= first_eval
        if refreshes.before_eval:  # the trained policy itself, not the engine's last version
            refresh(trainer, rollout, step + 1)
            version = step + 1
        if _eval_due(config, step + 1):
            metrics |= _evaluate(rollout, version)
        nonfinite = nonfinite + 1 if learned.skipped else 0
        if log is not None:
            log.log(step, metrics, samples)
        if nonfinite >= config.train.max_nonfinite_steps:
            trainer.saved("before stopping on non-finite losses")
            raise RuntimeError(f"{nonfinite} non-finite losses in a row (step {step}): stopping; lower optim.lr "
                               f"or check the data, then resume from {checkpoints.latest_checkpoint(run_dir)}")
        _persist(trainer, rollout, log, step + 1, version)
    if trainer.export_hf(run_dir / "hf") is not None:  # the trained policy, loadable by transformers
        logger.info("policy exported to %s", run_dir / "hf")
    if trainer.export_adapter(run_dir / "adapter") is not None:  # LoRA: the adapter alone, for PEFT on the base
        logger.info("adapter exported to %s", run_dir / "adapter")
    trainer.saved("at the end of the run")  # the last step's, written beside the exports
    summary = None
    if rollout is not None:
        rollout.close()
        log.close()
        # after the export and the last checkpoint: it names them
        summary = finish_summary(run_dir)
    return TrainResult(run_dir, summary)


def _start(trainer: TrainerSide, rollout: RolloutSide | None, log: MetricsLog | None) -> tuple[int, int]:
    """The step to start at and the version the engine serves. A new run: step 0, the exported version 0, verified
    before any sample comes from it. A resume: the checkpoint's step, whose weights the engine gets now, as the
    uninterrupted run's engine did at that step."""
    cfg = trainer.config
    checkpoint = checkpoints.latest_checkpoint(cfg.train.out_dir) if cfg.train.resume else None
    if cfg.train.resume and checkpoint is None:
        logger.warning("--resume: no complete checkpoint in %s/checkpoints: starting at step 0", cfg.train.out_dir)
    if log is not None and cfg.train.resume:
        log.resume_at(0 if checkpoint is None else checkpoints.checkpoint_step(checkpoint),
                      checkpoints.read_log_tail(checkpoint))
    if checkpoint is None:
        verify(trainer, rollout, 0)
        return 0, 0
    state = trainer.restore(checkpoint)
    if rollout is not None:
        rollout.load_resume_state(load_rollout_state(checkpoint, state))
    if changed := checkpoints.changed_keys(state.config, cfg.to_dict()):
        logger.warning("resume: keys changed since the checkpoint: %s", ", ".join(changed))
    step = state.step
    if step % cfg.rollout.refresh_every:
        logger.warning("resuming at step %d, not a multiple of refresh_every=%d: the engine gets the current weights "
                       "now (save_every a multiple of v keeps a resumed run identical)", step,
                       cfg.rollout.refresh_every)
    refresh(trainer, rollout, step)
    if (out := _export_dir(cfg.train, step)) is not None and not out.is_dir():  # the kill came during this export
        logger.warning("resume: %s was not written (the run stopped during it): writing it now", out)
        trainer.export_hf(out)
    return step, step


def _rollout(trainer: TrainerSide, rollout: RolloutSide | None, step: int, version: int, refreshes: StepRefresh,
             times: StepTimes) -> tuple[list[Sample], int, dict[str, float]]:
    """This step's samples on every rank, the engine's version after ``refreshes``, and rank 0's sampling metrics
    (``rollout.dynamic_sampling``'s group counts; {} elsewhere).

    The batch comes from the mode's source (``sampler._sources``): generated now (lockstep), taken from the async
    generator's buffer, or, with overlap, the batch generated during the previous step; overlap's refresh comes after
    it is collected, and then the next batch starts generating (from the new version) while the trainer learns.
    """
    if refreshes.before_batch:
        times.sync_s, version = refresh(trainer, rollout, step), step
    batch = None
    if rollout is not None:
        start = time.perf_counter()
        try:
            batch = rollout.batch(step)  # with overlap: only the wait is on the critical path
        except GENERATION_FAILURES as exc:
            share_samples(exc)  # the other ranks wait for the samples: they raise it too
            raise
        times.generate_s = time.perf_counter() - start
    if refreshes.after_batch:
        times.sync_s, version = refresh(trainer, rollout, step), step
    if rollout is not None:
        rollout.start(step + 1)
    return share_samples(None if batch is None else batch.samples), version, {} if batch is None else batch.metrics()


def _eval_due(config: Config, done: int) -> bool:
    """Every ``train.eval_every`` steps, and after the last."""
    every = config.train.eval_every
    return bool(every) and (done % every == 0 or done == config.train.steps)


def _evaluate(rollout: RolloutSide | None, version: int, prefix: str = "eval_") -> dict:
    """Greedy accuracy of the engine's weights on the eval prompts, tagged with their version (rank 0; {} elsewhere
    or without ``train.eval_every``). Collective: a failure on rank 0 (a dead engine) is raised on every rank."""
    result = {}

    def run() -> None:
        result.update(rollout.evaluate())

    on_rank0_shared(rollout, run, "evaluation")
    if not result:
        return {}
    return {f"{prefix}{key[len('eval_'):]}": value for key, value in result.items()} | {f"{prefix}version": version}


def _persist(trainer: TrainerSide, rollout: RolloutSide | None, log: MetricsLog | None, done: int,
             version: int) -> None:
    """After ``done`` steps: the checkpoint (every ``train.save_every``, and the last) and the periodic HF export
    (every ``train.export_every`` before the last, whose export is ``out_dir/hf``). Collective."""
    cfg = trainer.config.train
    trainer.saved()  # train.async_save: the checkpoint written in the background is published once it is done
    if _save_due(cfg, done):
        _save(trainer, rollout, log, done, version)
    if (out := _export_dir(cfg, done)) is not None and trainer.export_hf(out) is not None:
        logger.info("policy exported to %s", out)


def _export_dir(cfg: TrainConfig, done: int) -> Path | None:
    """Where the periodic HF export after ``done`` steps goes (``train.export_every``), or None when none is due
    (the last step's export is ``out_dir/hf``)."""
    if cfg.export_every and done % cfg.export_every == 0 and done < cfg.steps:
        return Path(cfg.out_dir) / "exports" / f"step_{done:08d}"
    return None


def _save_due(cfg: TrainConfig, done: int) -> bool:
    """Whether ``_persist`` checkpoints after ``done`` steps: every ``train.save_every``, and the last."""
    return bool(cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps


def _save(trainer: TrainerSide, rollout: RolloutSide | None, log: MetricsLog | None, done: int, version: int) -> None:
    """The checkpoint after ``done`` steps, published after the records of its steps are durable (``log_tail``)."""
    tail = None if log is None else log.checkpoint_tail()
    trainer.save(done, version, None if rollout is None else rollout.resume_state(), tail)


def _stopped(trainer: TrainerSide, rollout: RolloutSide | None, log: MetricsLog | None, signum: int, done: int,
             version: int, start: int) -> RunStopped:
    """Checkpoint after ``done`` steps unless one is there (the periodic save just wrote it, or the run resumed from
    it and has not stepped since), close the engine and the log; the ``RunStopped`` to raise. Collective: the
    decision is the same arithmetic on every rank, never a look at the disk that a rank could see differently."""
    run_dir = Path(trainer.config.train.out_dir)
    if done > start and not _save_due(trainer.config.train, done):
        _save(trainer, rollout, log, done, version)
    trainer.saved(f"before stopping on {signal.Signals(signum).name}")
    if rollout is not None:
        rollout.close()
        log.close()
    checkpoint = checkpoints.latest_checkpoint(run_dir) if done > 0 else None
    return RunStopped(signum, done, None if checkpoint is None else str(checkpoint))
