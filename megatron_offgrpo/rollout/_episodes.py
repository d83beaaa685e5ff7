"""Multi-turn episodes over any ``RolloutEngine``: the engine samples a turn, the environment answers, the next turn
continues from the exact tokens so far.

Token in / token out: each turn is a request whose prompt is the episode's token ids so far (the prompt, every
sampled turn, every observation), so the engine never sees text and the model's tokens are never re-encoded. An
observation is tokenised alone, wrapped as the chat template wraps its role (``data.chat.turn_wrapping``), and appended
after the model's end-of-turn token. The episode is one ``Sample``: its response holds the turns and the
observations in order, ``trainable`` marks the model's tokens (the loss trains those only), and every model token
keeps the behavior log-prob and the weight version of the turn that sampled it (observation tokens: log-prob 0,
the version of the turn before them, never trained).

A GRPO group is G episodes of one prompt: turn 1 asks the engine for G completions of the prompt (one request),
later turns one completion of each live episode. The live episodes' turns of a round are one ``generate`` call, so
an engine batches them, and the environments' steps of a round run in threads beside each other (a sandboxed tool
call is a process of its own). Every call of an environment's code is bounded (``EpisodeLimits.call_timeout_s``,
``envs.bounded_calls``) and what ``step`` returns is checked (``envs.checked_observation``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

from megatron_offgrpo.data import Prompt, Sample, SamplingParams, chat
from megatron_offgrpo.envs import Environment, EnvironmentCall, bounded_calls, checked_observation
from megatron_offgrpo.rollout._protocol import RolloutEngine

logger = logging.getLogger(__name__)

_TURN_SEED_STRIDE = 1_000_003  # turn k's requests sample with seed + k * stride (a prime): no turn repeats another's


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """When an episode ends besides the environment saying so.

    Attributes:
        max_turns: model turns per episode (>= 1).
        max_tokens: response tokens per episode, the model's and the environment's together (what the context must
            hold after the prompt); a turn is capped to what is left, and an observation that does not fit ends the
            episode as truncated ("length"); the first turn too.
        call_timeout_s: seconds one call of the environment's code (make, reset, step, close) may take
            (``env.step_timeout_s``): then ``EnvironmentTimeout``, and the call is abandoned (``envs._guard``).
    """

    max_turns: int
    max_tokens: int
    call_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1 or not self.call_timeout_s > 0:
            raise ValueError(f"episode limits: max_turns={self.max_turns}, max_tokens={self.max_tokens}: both >= 1; "
                             f"call_timeout_s={self.call_timeout_s}: > 0")


@dataclasses.dataclass
class EpisodeStats:
    """What a batch of episodes did (summed over its episodes)."""

    episodes: int = 0
    turns: int = 0
    tool_errors: int = 0
    env_seconds: float = 0.0
    truncated: int = 0  # ended by a token budget (a turn cut at its cap, or an observation with no room left)

    def metrics(self) -> dict[str, float]:
        if not self.episodes:
            return {}
        return {"episode_turns_mean": self.turns / self.episodes, "tool_error_rate": self.tool_errors / self.turns,
                "episode_truncated_fraction": self.truncated / self.episodes, "env_s": self.env_seconds}


@dataclasses.dataclass
class _Episode:
    """One episode in progress: the response so far, token by token."""

    prompt: Prompt
    group_id: int
    env: Environment
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    trainable: list[bool] = dataclasses.field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    finish_reason: str = "stop"
    last: Sample | None = None  # the latest turn as the engine returned it
    busy: bool = False  # a call of the environment is running (an abandoned one: it is never closed under it)

    def call(self, method: str, *args):
        """``env.<method>(*args)``, marked busy while it runs (on a worker thread)."""
        self.busy = True
        try:
            return getattr(self.env, method)(*args)
        finally:
            self.busy = False

    def add_turn(self, turn: Sample) -> None:
        self.ids += turn.response_ids
        self.logprobs += turn.behavior_logprobs
        self.versions += turn.token_versions or [turn.policy_version] * len(turn.response_ids)
        self.trainable += [True] * len(turn.response_ids)
        self.turns, self.finish_reason, self.last = self.turns + 1, turn.finish_reason, turn

    def add_observation(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)
        self.trainable += [False] * len(ids)

    def request(self, room: int) -> Prompt:
        """The next turn's request: everything so far as its prompt, capped to ``room`` new tokens."""
        return _capped(self.prompt, self.ids, room)

    def sample(self) -> Sample:
        last = self.last
        mixed = len(set(self.versions)) > 1
        return Sample(self.prompt.prompt_id, self.group_id, list(self.prompt.prompt_ids), self.ids, self.logprobs,
                      min(self.versions), self.finish_reason, reward=self.reward, server=last.server,
                      routed_experts=last.routed_experts, token_versions=self.versions if mixed else None,
                      attempts=last.attempts, trainable=self.trainable, turns=self.turns)


def _capped(prompt: Prompt, ids: list[int], room: int) -> Prompt:
    """A turn's request: ``prompt`` and the episode's ``ids`` so far, at most ``room`` new tokens (and at most the
    prompt's own cap)."""
    cap = room if prompt.max_new_tokens is None else min(room, prompt.max_new_tokens)
    return Prompt(prompt.prompt_id, prompt.prompt_ids + tuple(ids), prompt.text, prompt.answer, cap)


class EpisodeRunner:
    """Runs G episodes of each prompt on an engine against fresh environments; returns one ``Sample`` per episode."""

    def __init__(self, engine: RolloutEngine, make_env: Callable[[], Environment], tokenizer,
                 limits: EpisodeLimits, plain: bool = False, threads: int = 8) -> None:
        """Args:
            engine: samples the turns. make_env: a new environment per episode. tokenizer: the policy's (chat
            template, EOS, decoding the turns the environments read). limits: turns and tokens per episode.
            plain: the prompts are plain text (``data.prompt_format=plain``): observations go on lines of their own
            (``data.chat.PLAIN``) instead of the chat template's turns. threads: environment steps run at once.
        """
        self.engine, self.make_env, self.tokenizer, self.limits = engine, make_env, tokenizer, limits
        self.plain, self.threads = plain, threads
        self._wrapping: dict[str, chat.TurnWrapping] = {}

    def wrapping(self, role: str) -> chat.TurnWrapping:
        """How the chat template wraps an observation of ``role`` (found once per role)."""
        if role not in self._wrapping:
            self._wrapping[role] = chat.PLAIN if self.plain else chat.turn_wrapping(self.tokenizer, role)
        return self._wrapping[role]

    def run(self, prompts: Sequence[Prompt], group_size: int, params: SamplingParams,
            stats: EpisodeStats | None = None) -> list[Sample]:
        """``len(prompts) * group_size`` episodes, group-major (sample ``i`` is of prompt ``i // group_size``),
        each rewarded by its environment (the sum of its steps' rewards).

        Raises:
            EnvironmentTimeout: a call of an environment's code ran past ``limits.call_timeout_s``.
            EnvironmentContractError: an environment returned what its protocol does not allow.
        """
        stats = stats if stats is not None else EpisodeStats()
        episodes: list[_Episode] = []
        try:
            self._start(prompts, group_size, episodes)
            # the first turn is capped by the episode's budget too, as every later one (``_Episode.request``)
            first = [_capped(prompt, [], self.limits.max_tokens) for prompt in prompts]
            turns = self.engine.generate(first, group_size, params)
            if len(turns) != len(episodes):
                raise RuntimeError(f"engine returned {len(turns)} samples for {len(prompts)} prompts x G={group_size}")
            live, round_ = episodes, 1
            while live:
                for episode, turn in zip(live, turns):
                    episode.add_turn(turn)
                live = self._answer(live, stats)
                if live:
                    seed = None if params.seed is None else params.seed + round_ * _TURN_SEED_STRIDE
                    requests = [e.request(self.limits.max_tokens - len(e.ids)) for e in live]
                    turns = self.engine.generate(requests, 1, dataclasses.replace(params, seed=seed))
                    round_ += 1
        except BaseException:
            self._close(episodes, failing=True)  # the error in flight is the one to read, not a close's
            raise
        self._close(episodes)
        stats.episodes += len(episodes)
        stats.turns += sum(e.turns for e in episodes)
        stats.truncated += sum(e.finish_reason == "length" for e in episodes)
        return [e.sample() for e in episodes]

    def _start(self, prompts: Sequence[Prompt], group_size: int, episodes: list[_Episode]) -> None:
        """A fresh environment per episode, reset on its prompt, one after the other (as the factory's probe ran),
        each call bounded; ``episodes`` holds every one made, for the caller to close whatever happens."""
        timeout, factory = self.limits.call_timeout_s, getattr(self.make_env, "__qualname__", repr(self.make_env))
        for i, prompt in enumerate(prompts):
            for _ in range(group_size):
                env = bounded_calls([EnvironmentCall(f"factory {factory}()", self.make_env)], timeout)[0]
                episode = _Episode(prompt, i, env)
                episodes.append(episode)
                bounded_calls([EnvironmentCall(f"{type(env).__name__}.reset", lambda e=episode: e.call("reset",
                                                                                                      e.prompt))],
                              timeout)

    def _close(self, episodes: list[_Episode], failing: bool = False) -> None:
        """Close every environment at once, bounded; one whose call is still running (abandoned at its deadline) is
        left alone: the protocol never has two calls on an instance at once. With ``failing``, a close's own error
        is logged, not raised (it would hide the error that ended the episodes)."""
        idle = [e for e in episodes if not e.busy]
        if len(idle) < len(episodes):
            logger.warning("%d environment(s) not closed: a call of theirs is still running", len(episodes) - len(idle))
        calls = [EnvironmentCall(f"{type(e.env).__name__}.close", lambda e=e: e.call("close")) for e in idle]
        try:
            bounded_calls(calls, self.limits.call_timeout_s, threads=max(len(calls), 1))
        except Exception as exc:
            if not failing:
                raise
            logger.warning("closing the environments after a failure: %s", exc)

    def _answer(self, live: list[_Episode], stats: EpisodeStats) -> list[_Episode]:
        """Each live episode's environment answers its latest turn; returns the episodes that go on (their
        observations appended)."""
        # A turn cut at its token cap has no end-of-turn token to continue after: the episode ends there.
        asking = [e for e in live if e.finish_reason == "stop"]
        start = time.perf_counter()
        texts = [self.tokenizer.decode(e.last.response_ids, skip_special_tokens=True) for e in asking]
        calls = [EnvironmentCall(f"{type(e.env).__name__}.step", lambda e=e, t=t: e.call("step", t))
                 for e, t in zip(asking, texts)]
        answers = bounded_calls(calls, self.limits.call_timeout_s, self.threads)
        observations = [checked_observation(c.what, obs) for c, obs in zip(calls, answers)]
        stats.env_seconds += time.perf_counter() - start
        going_on = []
        for episode, obs in zip(asking, observations):
            episode.reward += obs.reward
            stats.tool_errors += obs.tool_error
            if obs.done or episode.turns >= self.limits.max_turns:
                continue
            ids = chat.observation_ids(self.tokenizer, self.wrapping(obs.role), obs.text)
            if len(episode.ids) + len(ids) >= self.limits.max_tokens:
                episode.finish_reason = "length"  # no room for the observation and a token of the next turn
                continue
            episode.add_observation(ids)
            going_on.append(episode)
        return going_on
