"""Rank 0's side of the wall: build the engine, refresh and verify it, generate and score, share the samples."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.train._eval import EVAL_BATCH


def make_rollout_engine(config: Config, model_dir: Path, run_dir: Path | None, max_positions: int):
    """The engine of ``rollout.engine``, serving the weights in ``model_dir`` as version 0 (rank 0 only).

    Args:
        run_dir: the run directory (a disk refresh writes its versions under it; None: an engine never refreshed).
        max_positions: the model's ``max_position_embeddings`` (caps vLLM's ``max_model_len``).
    """
    from megatron_offgrpo.rollout import make_engine
    from megatron_offgrpo.train.builders import serving_dtype

    r = config.rollout
    if r.engine == "fleet":
        return make_engine("fleet", state=r.fleet_state, transport=r.transport,
                           shared_dir=None if run_dir is None else run_dir / "weights",
                           bucket_bytes=r.bucket_mb * 1024**2, collective_host=_collective_host(r), shm_dir=r.shm_dir)
    if r.engine in ("vllm", "auto"):
        # explicit: vLLM's "auto" may serve fp32 weights in bf16 on CPU, and the probe check would (rightly) fail
        return make_engine(r.engine, model_dir, dtype=serving_dtype(config.model.precision),
                           max_model_len=generation_length(config, max_positions),
                           max_num_seqs=max(r.prompts_per_step * r.group_size, EVAL_BATCH))
    return make_engine(r.engine, model_dir)


def generation_length(config: Config, max_positions: int) -> int:
    """The longest sequence a run generates (prompt + completion), capped by the model's positions."""
    return min(max_positions, config.data.max_prompt_tokens + config.rollout.max_new_tokens)


def _collective_host(r) -> str | None:
    """Where the fleet's workers reach this process (rank 0) for a collective refresh: ``rollout.collective_host``,
    else loopback when every server is on this machine, else this node's name. Rank 0's node is only known at run
    time (c10d rendezvous picks it), so a multi-node launcher cannot write it into the recipe."""
    if r.collective_host is not None or r.transport != "collective":
        return r.collective_host
    import socket
    from urllib.parse import urlparse

    from megatron_offgrpo.fleet import is_loopback, load_state

    hosts = {urlparse(s.url).hostname for s in load_state(r.fleet_state).servers}
    return None if all(is_loopback(host) for host in hosts) else socket.getfqdn()


def generate_and_score(engine, prompts: Sequence[Prompt], group_size: int, params: SamplingParams, reward_fn,
                       tokenizer) -> tuple[list[Sample], float]:
    """G samples per prompt from the engine, each scored; returns them and the seconds spent generating."""
    start = time.perf_counter()
    samples = engine.generate(list(prompts), group_size, params)
    seconds = time.perf_counter() - start
    if len(samples) != len(prompts) * group_size:
        raise RuntimeError(f"engine returned {len(samples)} samples for {len(prompts)} prompts x G={group_size}")
    for sample in samples:
        prompt = prompts[sample.group_id]
        sample.reward = float(reward_fn(tokenizer.decode(sample.response_ids, skip_special_tokens=True), prompt.answer))
    return samples, seconds


def broadcast_samples(samples: list[Sample] | None) -> list[Sample]:
    """Rank 0's samples on every rank (every rank needs them: all stages build the same micro-batches)."""
    box = [samples]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def staleness(samples: Sequence[Sample], step: int, bound: int) -> dict[str, float]:
    """Staleness (step - policy_version) statistics; raises when a sample exceeds ``bound``."""
    values = [step - s.policy_version for s in samples]
    if max(values) > bound or min(values) < 0:
        raise RuntimeError(
            f"step {step}: sample staleness {min(values)}..{max(values)} outside [0, {bound}] "
            f"(versions {sorted({s.policy_version for s in samples})}): the engine did not serve the expected weights"
        )
    hist = collections.Counter(values)
    return {"staleness_max": max(values), "staleness_mean": sum(values) / len(values),
            **{f"staleness_{k}": hist[k] / len(values) for k in range(bound + 1)}}


def rewards_tensor(samples: Sequence[Sample]) -> torch.Tensor:
    """[B*G] rewards in sample order."""
    return torch.tensor([s.reward for s in samples], dtype=torch.float64)
