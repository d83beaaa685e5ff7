"""Supervised warm-up: teach the answer format (and some answers) before RL, with the same fused step.

Cross-entropy on the reference answer is the GPG objective with every advantage = 1 (loss ``-logp``, token mean),
so the warm-up reuses ``policy_step`` and the fused kernel unchanged. The result is written as a HF directory
(``train.out_dir/hf``) that an RL recipe starts from (``model.init=hf``). A warm-up has no checkpoints: SIGTERM /
SIGINT stop it at the next step boundary without writing ``hf/`` (a half warm-up would look like a finished one).

    offgrpo sft --config configs/tiny-cpu-sft.yaml [key=value ...]
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import torch

from megatron_offgrpo.algo import ObjectiveParams
from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Prompt, PromptStream, Sample, rewards
from megatron_offgrpo.model import QwenArch, load_arch, load_tokenizer, resolve_model_dir
from megatron_offgrpo.runlog import MetricsLog, open_metrics_log, write_run_info
from megatron_offgrpo.runtime import ParallelContext, init_parallel
from megatron_offgrpo.sampler import build_prompts, load_data, log_data
from megatron_offgrpo.train._batch import build_microbatches
from megatron_offgrpo.train._packing import build_packed_microbatches
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._step import policy_step, sequence_shard
from megatron_offgrpo.train._stop import RunStopped, StopRequest
from megatron_offgrpo.train._weights import export_hf_dir

logger = logging.getLogger(__name__)
SFT_OBJECTIVE = ObjectiveParams(objective="gpg")


def reference_sample(prompt: Prompt, index: int, tokenizer, off_by_one: bool = False) -> Sample:
    """The prompt answered in the format the reward checks (``#### N`` then EOS): N is the ground truth, or the ground
    truth plus one where ``off_by_one`` (the deliberately wrong teacher of ``sft.off_by_one_fraction``)."""
    answer = rewards.extract_answer(prompt.answer or "")
    if answer is None:
        raise ValueError(f"prompt {prompt.prompt_id}: no numeric ground truth to warm up on")
    if off_by_one:
        if not answer.lstrip("-").isdigit():
            raise ValueError(f"prompt {prompt.prompt_id}: sft.off_by_one_fraction needs integer answers, "
                             f"got {answer!r}")
        answer = str(int(answer) + 1)
    ids = tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
    return Sample(prompt.prompt_id, index, list(prompt.prompt_ids), ids, [0.0] * len(ids), 0, "stop", reward=1.0)


def teacher_batch(prompts: list[Prompt], tokenizer, teacher: random.Random, off_by_one_fraction: float) -> list[Sample]:
    """The warm-up answers of one step: each the ground truth, or with probability ``off_by_one_fraction`` (drawn
    from ``teacher``, its own stream so that the prompt order does not depend on the fraction) the ground truth + 1."""
    return [reference_sample(p, i, tokenizer, teacher.random() < off_by_one_fraction) for i, p in enumerate(prompts)]


def sft(config: Config) -> Path:
    """Warm up the model of ``config`` for ``train.steps`` steps; returns the HF directory written.

    Raises:
        RunStopped: SIGTERM or SIGINT (any rank): stopped at the next step boundary, every rank at the same one.
    """
    with StopRequest() as stop:
        return _sft(config, stop)


def _sft(config: Config, stop: StopRequest) -> Path:
    started = time.time()
    ctx = init_parallel(config.parallel.tp, config.parallel.pp, config.parallel.seed, ep=config.parallel.ep,
                        etp=config.parallel.etp)
    config.model.hf_path = str(resolve_model_dir(config.model.hf_path))  # once: hub id / bundled asset -> dir
    arch = load_arch(config.model.hf_path)
    policy = build_policy(arch, ctx, config.model, config.optim, config.train.steps,
                          config.parallel.sequence_parallel)
    tokenizer = load_tokenizer(config.model.hf_path)
    data = load_data(config)  # the training side only: the questions an RL run after it evaluates stay unseen
    stream = PromptStream(build_prompts(config, tokenizer, data.train), config.parallel.seed)
    batch = config.rollout.prompts_per_step * config.rollout.group_size
    teacher = random.Random(config.parallel.seed + 1)
    log = _open_log(config, ctx, arch, tokenizer, started, log_data(config, data)) if ctx.rank == 0 else None
    for step in range(config.train.steps):
        stop.step = step
        if signum := stop.agreed(ctx.device):
            if log is not None:
                log.close()
            raise RunStopped(signum, step, None,
                             f"a warm-up has no checkpoints, {config.train.out_dir}/hf not written: run it again")
        start = time.perf_counter()
        samples = teacher_batch(stream.next_batch(batch), tokenizer, teacher, config.sft.off_by_one_fraction)
        ones = torch.ones(len(samples), dtype=torch.float64)
        build = build_packed_microbatches if config.optim.packing else build_microbatches
        mbs = build(samples, ones, torch.ones(len(samples), dtype=torch.bool), 1, ctx.dp_rank, ctx.dp_size,
                    config.optim.micro_batch_tokens, device=ctx.device,
                    seq_multiple=sequence_shard(policy.model, ctx)[1])
        tokens = sum(len(s.response_ids) for s in samples)
        lr = policy.optimizer.param_groups[0]["lr"]  # this step's
        result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, SFT_OBJECTIVE, tokens, len(samples))
        policy.scheduler.step(increment=1)
        if log is not None:
            seconds = time.perf_counter() - start
            log.log(step, {"loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped, "lr": lr,
                           "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9), "time_step_s": seconds},
                    samples)
    out = Path(config.train.out_dir) / "hf"
    export_hf_dir(policy.model, arch, ctx, out, Path(config.model.hf_path))
    if log is not None:
        log.close()
        logger.info("warm-up model written to %s", out)
    return out


def sft_progress(values: dict[str, Any]) -> str:
    """The middle of a warm-up step's progress line: cross-entropy, learning rate, throughput."""
    return (f"cross-entropy {values.get('loss', float('nan')):.4f} lr {values.get('lr', 0):.2e} "
            f"{values.get('tokens_per_s', 0):.0f} tok/s")


def _open_log(config: Config, ctx: ParallelContext, arch: QwenArch, tokenizer, started: float,
              data: dict) -> MetricsLog:
    """Rank 0's metrics log of the warm-up, and its ``run_info.json`` (``data``: the set sizes, the evaluation set
    being the one the warm-up keeps out). A warm-up has no resume: ``offgrpo sft`` follows ``offgrpo train``'s
    run-directory rules (``runlog._run_dir.claim_run_dir``), so it starts in a directory without an earlier run's
    records (one moved aside by ``train.overwrite``), and starts new tracker runs."""
    run_dir = Path(config.train.out_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_run_info(run_dir, config, ctx, arch, started, data=data)
    log = open_metrics_log(config, tokenizer, sft_progress, resume=False)
    log.resume_at(0)
    return log
