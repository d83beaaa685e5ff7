"""Config sections -> the flat arguments of the components (the only place that reads the config for them)."""

from __future__ import annotations

from pathlib import Path

from megatron_offgrpo.config import Config, RolloutConfig
from megatron_offgrpo.data import SamplingParams
from megatron_offgrpo import reward
from megatron_offgrpo.rollout import specs
from megatron_offgrpo.sampler._eval import EVAL_BATCH
from megatron_offgrpo.transports import adapters


def sampling_params(rollout: RolloutConfig, seed: int | None = None, step: int = 0) -> SamplingParams:
    """How the engine samples step ``step``'s requests. In async mode several steps generate at once: their
    requests are admitted oldest step first (``SamplingParams.priority``), since the trainer takes them in order."""
    return SamplingParams(max_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                          seed=seed, priority=step if rollout.asynchronous() else 0)


def verify_tolerance(rollout: RolloutConfig, precision: str, derived: float | None = None) -> float:
    """Max |fleet - trainer| probe log-prob after a refresh: ``rollout.verify_tolerance`` when set; else, serving
    float32, ``derived`` (``rollout.probes.probe_bound`` of the model, from the trainer) when given; else the
    ``rollout.probes.PROBE_ATOL`` default of the serving dtype (the coarser side decides the agreement)."""
    from megatron_offgrpo.rollout import probes

    if rollout.verify_tolerance is not None:
        return rollout.verify_tolerance
    if derived is not None and rollout.serving_dtype(precision) == "float32":
        return derived
    return probes.probe_atol(rollout.serving_dtype(precision))


def engine_spec(config: Config, model_dir: Path, run_dir: Path | None, max_positions: int,
                adapter: adapters.AdapterSpec | None = None) -> specs.EngineSpec:
    """The spec of ``rollout.engine``'s engine (``make_rollout_engine``'s arguments); ``adapter``: the policy's LoRA
    adapter when refreshes send only it (``lora.sync=adapter``)."""
    r, routing = config.rollout, config.model.router_replay
    if r.engine == "fleet":
        return specs.FleetClientSpec(
            Path(r.fleet_state), r.transport, shared_dir=None if run_dir is None else run_dir / "weights",
            bucket_bytes=r.bucket_mb * 1024**2, collective_host=_collective_host(r), shm_dir=Path(r.shm_dir),
            record_routing=routing, partial_rollouts=r.mode == "async_partial", lora=adapter)
    # the dtype explicit: vLLM's "auto" may serve fp32 weights in bf16 on CPU, and the probe check would (rightly) fail
    dtype = r.serving_dtype(config.model.precision)
    if r.engine == "transformers":
        return specs.TransformersSpec(model_dir, dtype, record_routing=routing)
    return specs.VllmSpec(model_dir, dtype, max_model_len=generation_length(config, max_positions),
                          max_num_seqs=max(r.prompts_per_step * r.group_size, EVAL_BATCH), record_routing=routing,
                          partial_rollouts=r.mode == "async_partial", fall_back=r.engine == "auto", lora=adapter)


def generation_length(config: Config, max_positions: int) -> int:
    """The longest sequence a run generates (prompt + completion, or a multi-turn episode), capped by the model's
    positions."""
    r = config.rollout
    response = config.env.episode_tokens(r.max_new_tokens) if config.env.name else r.max_new_tokens
    return min(max_positions, config.data.max_prompt_tokens + response)


def _collective_host(r) -> str | None:
    """Where the fleet's workers reach this process (rank 0) for a collective refresh: ``rollout.collective_host``,
    else loopback when every server is on this machine, else this node's name. Rank 0's node is only known at run
    time (c10d rendezvous picks it), so a multi-node launcher cannot write it into the recipe."""
    if r.collective_host is not None or r.transport != "collective":
        return r.collective_host
    import socket
    from urllib.parse import urlparse

    from megatron_offgrpo.fleet import launcher, load_state

    hosts = {urlparse(s.url).hostname for s in load_state(r.fleet_state).servers}
    return None if all(launcher.is_loopback(host) for host in hosts) else socket.getfqdn()


def reward_spec(config: Config) -> reward.RewardSpec | None:
    """The reward model of ``reward.*`` (None without one). Raises ``TemplateError`` for a judge template that does
    not load."""
    r = config.reward
    if not r.on:
        return None
    mix = reward.RewardMix(r.rule_weight, r.model_weight, r.clip, r.normalize)
    judge = None
    if r.judge:
        judge = reward.JudgeSettings(reward.JudgeTemplate.load(r.judge_template), r.judge_max_tokens,
                                     r.judge_temperature, r.unparsed, r.judge_attempts, r.judge_soft)
    return reward.RewardSpec("judge" if r.judge else "classifier", r.judge or r.model, r.fleet, judge, mix,
                             config.parallel.seed, r.timeout_s)
