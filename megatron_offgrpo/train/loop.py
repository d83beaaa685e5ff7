"""The off-policy GRPO driver: refresh every v steps, generate, score, advantages, optimise, and at the end write
the trained policy as a HF directory (``out_dir/hf``; ``out_dir/exports/step_N`` every ``train.export_every``).
No formulas here.

    torchrun --nproc_per_node N -m megatron_offgrpo.train --config configs/tiny-cpu.yaml [key=value ...]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from megatron_offgrpo.algo import compute_group_advantages
from megatron_offgrpo.config import Config
from megatron_offgrpo.train import _rollout_side as R
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._eval import evaluate
from megatron_offgrpo.train._checkpoint import (
    changed_keys,
    checkpoint_step,
    latest_checkpoint,
    load_checkpoint,
    resume_schedule,
    save_checkpoint,
)
from megatron_offgrpo.train._setup import Run, setup_run
from megatron_offgrpo.train._step import policy_step, token_logprobs
from megatron_offgrpo.train._sync import refresh_engine, verify_engine
from megatron_offgrpo.train._weights import export_hf_dir, hf_extra_dirs, model_card

logger = logging.getLogger(__name__)


def _behavior_and_ref(run: Run, microbatches) -> None:
    """Exact behavior log-probs (from the snapshot of the pushed weights) and reference log-probs, in place."""
    temperature = run.config.rollout.temperature
    if run.snapshot is not None:
        for mb, logp in zip(microbatches, token_logprobs(run.snapshot, run.ctx, microbatches, temperature)):
            mb.behavior_logp = torch.where(mb.loss_mask, logp, mb.behavior_logp)
    if run.reference is not None:
        for mb, logp in zip(microbatches, token_logprobs(run.reference, run.ctx, microbatches, temperature)):
            mb.ref_logp = logp


def _generate(run: Run, step: int):
    """Rank 0: the next prompts, G samples each, scored; with a fresh reproducible sampling seed per step."""
    cfg = run.config
    prompts = run.stream.next_batch(cfg.rollout.prompts_per_step)
    params = dataclasses.replace(run.sampling, seed=cfg.parallel.seed + 100_003 * step)
    return R.generate_and_score(run.engine, prompts, cfg.rollout.group_size, params, run.reward_fn, run.tokenizer)


def _rollout(run: Run, step: int, times: dict) -> list:
    """This step's samples on every rank; refreshes the engine when due (before generating, or, with overlap,
    after collecting the batch generated during the previous step and before prefetching the next one)."""
    cfg, rank0 = run.config, run.ctx.rank == 0
    due = step - run.version >= cfg.rollout.refresh_every
    samples = None
    if not cfg.rollout.overlap:
        if due:
            times["time_sync_s"] = refresh_engine(run, step)
        if rank0:
            samples, times["time_generate_s"] = _generate(run, step)
        return R.broadcast_samples(samples)
    if rank0:
        start = time.perf_counter()
        samples, _ = run.pending.result() if run.pending is not None else _generate(run, step)
        times["time_generate_s"] = time.perf_counter() - start  # only the wait is on the critical path
    if due:
        times["time_sync_s"] = refresh_engine(run, step)
    if rank0 and step + 1 < cfg.train.steps:
        run.pending = run.executor.submit(_generate, run, step + 1)
    return R.broadcast_samples(samples)


def train_one_step(run: Run, step: int) -> dict:
    """Refresh (every v), generate + score (rank 0), advantages, optimise. Returns the step's metrics."""
    cfg, ctx = run.config, run.ctx
    times = {"time_sync_s": 0.0, "time_generate_s": 0.0}
    samples = _rollout(run, step, times)
    stale = R.staleness(samples, step, cfg.rollout.refresh_every - 1 + int(cfg.rollout.overlap))
    start = time.perf_counter()
    adv = compute_group_advantages(R.rewards_tensor(samples), cfg.rollout.group_size, run.adv_params)
    mbs = build_microbatches(samples, adv.advantages, adv.sample_valid, cfg.rollout.group_size, ctx.dp_rank,
                             ctx.dp_size, cfg.optim.micro_batch_tokens, device=ctx.device)
    _behavior_and_ref(run, mbs)
    result = policy_step(run.policy.ddp, run.policy.optimizer, ctx, mbs, run.obj_params,
                         global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid),
                         cfg.rollout.temperature)
    if not result.skipped:
        run.policy.scheduler.step(increment=1)
    times["time_train_s"] = time.perf_counter() - start
    rewards = R.rewards_tensor(samples)
    tokens = sum(len(s.response_ids) for s in samples)
    return {"loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped,
            "reward_mean": float(rewards.mean()), "accuracy": float((rewards >= 1.0).double().mean()),
            "response_len": tokens / len(samples), "policy_version": run.version,
            "lr": run.policy.optimizer.param_groups[0]["lr"], **adv.metrics(), **result.metrics, **stale, **times,
            "tokens_per_s": tokens / max(sum(times.values()), 1e-9)}


def train(config: Config) -> Path:
    """Run (or resume) a training job; returns the run directory. Collective over all torchrun ranks."""
    run = setup_run(config)
    cfg = run.config
    start_step, nonfinite = 0, 0
    ckpt = latest_checkpoint(cfg.train.out_dir) if cfg.train.resume else None
    if cfg.train.resume and ckpt is None:
        logger.warning("--resume: no complete checkpoint in %s/checkpoints: starting at step 0", cfg.train.out_dir)
    if run.log is not None and cfg.train.resume:
        run.log.resume_at(0 if ckpt is None else checkpoint_step(ckpt))
    initial_eval: dict = {}
    if ckpt is None:
        verify_engine(run, 0)  # the engine started from the exported version 0: check it before sampling from it
        initial_eval = _evaluate(run, "eval_start_")  # the policy before any update: what the run improves on
    else:
        state = load_checkpoint(ckpt, run.policy.model, run.policy.optimizer)
        start_step = state["step"]
        run.stream.load_state_dict(state["stream"])
        resume_schedule(run.policy.scheduler, state["scheduler"])
        if changed := changed_keys(state.get("config"), cfg.to_dict()):
            logger.warning("resume: keys changed since the checkpoint: %s", ", ".join(changed))
        if start_step % cfg.rollout.refresh_every:
            logger.warning("resuming at step %d, not a multiple of refresh_every=%d: the engine gets the current "
                           "weights now (save_every a multiple of v keeps a resumed run identical)",
                           start_step, cfg.rollout.refresh_every)
        # An uninterrupted run refreshed at this step with these weights; the resumed one does the same.
        refresh_engine(run, start_step)
    for step in range(start_step, cfg.train.steps):
        metrics = train_one_step(run, step)
        if step == start_step:
            metrics.update(initial_eval)
        metrics.update(_scheduled_eval(run, step + 1))
        nonfinite = nonfinite + 1 if metrics["skipped"] else 0
        if run.log is not None:
            run.log.log(step, metrics)
        if nonfinite >= cfg.train.max_nonfinite_steps:
            raise RuntimeError(f"{nonfinite} non-finite losses in a row (step {step}): stopping; lower optim.lr "
                               f"or check the data, then resume from {latest_checkpoint(cfg.train.out_dir)}")
        _persist(run, step + 1)
    _export(run, Path(cfg.train.out_dir) / "hf")  # the trained policy, loadable by transformers
    run.close()
    return Path(cfg.train.out_dir)


def _scheduled_eval(run: Run, done: int) -> dict:
    """Every ``train.eval_every`` steps: the accuracy of the engine's version (the last pushed, up to v - 1 steps
    old); after the last step: of the trained policy itself, pushed to the engine for it. Collective."""
    every, steps = run.config.train.eval_every, run.config.train.steps
    if not every or (done % every and done != steps):
        return {}
    if done == steps:
        refresh_engine(run, done)
    return _evaluate(run)


def _evaluate(run: Run, prefix: str = "eval_") -> dict:
    """Greedy accuracy of the engine's weights on the eval prompts (rank 0; {} elsewhere or without
    train.eval_every)."""
    cfg = run.config
    if not cfg.train.eval_every or run.ctx.rank != 0:
        return {}
    result = evaluate(run.engine, run.eval_prompts, run.reward_fn, run.tokenizer, cfg.rollout.max_new_tokens)
    return {f"{prefix}{key[len('eval_'):]}": value for key, value in result.items()} | {f"{prefix}version": run.version}


def _export(run: Run, out: Path) -> None:
    """The current policy as a HF directory at ``out`` (atomic, replaces an older one; collective)."""
    if export_hf_dir(run.policy.model, run.arch, run.ctx, out, Path(run.config.model.hf_path)) is not None:
        logger.info("policy exported to %s", out)


def _persist(run: Run, done: int) -> None:
    """After ``done`` steps: the checkpoint (every save_every, and the last) and the periodic HF export (every
    export_every before the last, whose export is ``out_dir/hf``). Collective."""
    cfg = run.config.train
    if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
        source = Path(run.config.model.hf_path)
        save_checkpoint(cfg.out_dir, done, run.policy.model, run.policy.optimizer,
                        {"version": run.version, "stream": run.stream.state_dict(),
                         "scheduler": run.policy.scheduler.state_dict(), "config": run.config.to_dict()},
                        card=model_card(run.policy.model, run.arch, run.ctx, source), extra_dirs=hf_extra_dirs(source))
    if cfg.export_every and done % cfg.export_every == 0 and done < cfg.steps:
        _export(run, Path(cfg.out_dir) / "exports" / f"step_{done:08d}")
