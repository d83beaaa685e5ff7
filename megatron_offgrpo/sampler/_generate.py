"""Prompts -> rewarded samples, the one way both training and evaluation get them: one completion per sample scored
by the task's reward, or (``env.name``) one multi-turn episode per sample rewarded by its environment."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.envs import Environment, SandboxLimits, environment_factory
from megatron_offgrpo.rollout import RolloutEngine, multiturn


def env_factory(config: Config, reward_fn: Callable[[str, str | None], float]) -> Callable[[], Environment] | None:
    """The environment of each episode (``env.name``), or None for single-turn.

    Raises:
        ValueError: an ``env.name`` that is not shipped, does not import, or does not make an ``Environment``.
        EnvironmentContractError: its factory does not make an ``Environment``. EnvironmentTimeout: its factory (or
            the probe's close) ran past ``env.step_timeout_s``.
    """
    env = config.env
    if not env.name:
        return None
    limits = SandboxLimits(cpu_seconds=env.tool_cpu_s, wall_seconds=env.tool_wall_s,
                           memory_bytes=env.tool_memory_mib * 2**20, output_bytes=env.tool_output_bytes)
    return environment_factory(env.name, reward_fn, limits, env.step_timeout_s)


@dataclasses.dataclass
class Rollouts:
    """Generates and rewards samples on ``engine`` (thread-safe as far as the engine is: async steps share it).

    Attributes:
        episodes: the multi-turn runner (``env.name`` set), else None (single-turn).
    """

    engine: RolloutEngine
    tokenizer: object
    reward_fn: Callable[[str, str | None], float]
    episodes: multiturn.EpisodeRunner | None = None

    @classmethod
    def build(cls, config: Config, engine: RolloutEngine, tokenizer, reward_fn,
              make_env: Callable[[], Environment] | None = None) -> Rollouts:
        """Single-turn, or episodes against ``make_env``'s environments (``env_factory``: made before the engine
        starts, so a bad ``env.name`` stops the run before it)."""
        runner = None
        if make_env is not None:
            limits = multiturn.EpisodeLimits(config.env.max_turns,
                                             config.env.episode_tokens(config.rollout.max_new_tokens),
                                             config.env.step_timeout_s)
            runner = multiturn.EpisodeRunner(engine, make_env, tokenizer, limits,
                                             plain=config.data.prompt_format == "plain")
        return cls(engine, tokenizer, reward_fn, runner)

    def __call__(self, prompts: Sequence[Prompt], n: int, params: SamplingParams,
                 stats: multiturn.EpisodeStats | None = None) -> list[Sample]:
        """``len(prompts) * n`` samples, grouped by prompt, each with its reward (shaping not included); episodes
        add their counts to ``stats``."""
        if self.episodes is not None:
            return self.episodes.run(prompts, n, params, stats)
        samples = self.engine.generate(list(prompts), n, params)
        for sample in samples:
            text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            sample.reward = float(self.reward_fn(text, prompts[sample.group_id].answer))
        return samples
