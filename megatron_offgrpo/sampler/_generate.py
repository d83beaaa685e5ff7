"""Prompts -> rewarded samples, the one way both training and evaluation get them: one completion per sample scored
by the task's reward (and a reward model's, ``reward.*``), or (``env.name``) one multi-turn episode per sample
rewarded by its environment."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Sequence

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Prompt, Sample, SamplingParams
from megatron_offgrpo.envs import Environment, SandboxLimits, environment_factory
from megatron_offgrpo.reward import RewardModel
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
class ScoreTiming:
    """What a reward model's scoring cost a step (summed over its generation rounds).

    Attributes:
        scoring_s: seconds spent scoring, summed over the groups (scored several at once, it exceeds the wall time).
        exposed_s: wall seconds from the end of a round's last generation to its last score: what scoring adds to
            the step. Scored as each group finishes, only the last groups' scoring is left after the generation.
    """

    scoring_s: float = 0.0
    exposed_s: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, scoring_s: float, exposed_s: float) -> None:
        with self._lock:
            self.scoring_s += scoring_s
            self.exposed_s += exposed_s

    def metrics(self) -> dict[str, float]:
        """``reward_model_s`` and ``reward_model_exposed_s`` (metrics.jsonl)."""
        return {"reward_model_s": self.scoring_s, "reward_model_exposed_s": self.exposed_s}


@dataclasses.dataclass
class Rollouts:
    """Generates and rewards samples on ``engine`` (thread-safe as far as the engine is: async steps share it).

    Attributes:
        episodes: the multi-turn runner (``env.name`` set), else None (single-turn).
        reward_model: scores completions beside the rule (``reward.model`` or ``reward.judge``), else None.
        overlap: a reward model scores each group as soon as it is generated, while the others generate (engines
            that generate concurrently); False: once the whole round is generated.
    """

    engine: RolloutEngine
    tokenizer: object
    reward_fn: Callable[[str, str | None], float]
    episodes: multiturn.EpisodeRunner | None = None
    reward_model: RewardModel | None = None
    overlap: bool = True

    @classmethod
    def build(cls, config: Config, engine: RolloutEngine, tokenizer, reward_fn,
              make_env: Callable[[], Environment] | None = None,
              reward_model: RewardModel | None = None) -> Rollouts:
        """Single-turn, or episodes against ``make_env``'s environments (``env_factory``: made before the engine
        starts, so a bad ``env.name`` stops the run before it)."""
        runner = None
        if make_env is not None:
            limits = multiturn.EpisodeLimits(config.env.max_turns,
                                             config.env.episode_tokens(config.rollout.max_new_tokens),
                                             config.env.step_timeout_s)
            runner = multiturn.EpisodeRunner(engine, make_env, tokenizer, limits,
                                             plain=config.data.prompt_format == "plain")
        return cls(engine, tokenizer, reward_fn, runner, reward_model, config.reward.overlap)

    def __call__(self, prompts: Sequence[Prompt], n: int, params: SamplingParams,
                 stats: multiturn.EpisodeStats | None = None, timing: ScoreTiming | None = None) -> list[Sample]:
        """``len(prompts) * n`` samples, grouped by prompt, each with its reward (shaping not included); episodes
        add their counts to ``stats``, a reward model its seconds to ``timing``."""
        if self.episodes is not None:
            return self.episodes.run(prompts, n, params, stats)
        if self.reward_model is None:
            samples = self.engine.generate(list(prompts), n, params)
            for sample in samples:
                sample.reward = float(self.reward_fn(self._text(sample), prompts[sample.group_id].answer))
            return samples
        timing = timing if timing is not None else ScoreTiming()
        if not (self.overlap and self.engine.concurrent_generate and len(prompts) > 1):
            samples = self.engine.generate(list(prompts), n, params)
            generated, busy = time.monotonic(), 0.0
            for b, prompt in enumerate(prompts):
                busy += self._score(prompt, samples[b * n:(b + 1) * n])
            timing.add(busy, time.monotonic() - generated)
            return samples
        return self._scored_as_generated(prompts, n, params, timing)

    def _scored_as_generated(self, prompts: Sequence[Prompt], n: int, params: SamplingParams,
                             timing: ScoreTiming) -> list[Sample]:
        """Each group generated by a request of its own, all in flight at once (the engine batches them), and
        scored as soon as it is back. Group b samples with ``seed + b``, as in one request for the round."""
        ends: list[tuple[float, float, float]] = []  # per group: generated at, scored at, seconds scoring

        def group(b: int) -> list[Sample]:
            seeded = params if params.seed is None else dataclasses.replace(params, seed=params.seed + b)
            samples = self.engine.generate([prompts[b]], n, seeded)
            generated = time.monotonic()
            for sample in samples:
                sample.group_id = b
            busy = self._score(prompts[b], samples)
            ends.append((generated, time.monotonic(), busy))
            return samples

        with concurrent.futures.ThreadPoolExecutor(len(prompts), thread_name_prefix="offgrpo-scored-group") as pool:
            groups = list(pool.map(group, range(len(prompts))))
        timing.add(sum(e[2] for e in ends), max(0.0, max(e[1] for e in ends) - max(e[0] for e in ends)))
        return [sample for samples in groups for sample in samples]

    def _score(self, prompt: Prompt, samples: list[Sample]) -> float:
        """Rule and model rewards of one group (the rule's kept as gold when the prompt has an answer); the seconds
        the model took."""
        texts = [self._text(s) for s in samples]
        rule = [float(self.reward_fn(text, prompt.answer)) for text in texts]
        if prompt.answer is not None:
            for sample, value in zip(samples, rule):
                sample.gold_reward = value
        start = time.monotonic()
        self.reward_model.score_group(prompt, samples, texts, rule)
        return time.monotonic() - start

    def _text(self, sample: Sample) -> str:
        return self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
