"""Multi-turn episodes on a real engine: token in, token out.

The model ends its turns with EOS after ~5 tokens (``tests.helpers.turn_ending_model``), so episodes reach several
turns. Checked on every episode: the response is the sampled turns and the environment's observations in order,
only the model's tokens are trainable, the environment read exactly the decoded turns, and each model token's
behavior log-prob is the HF model's log-prob of that token given everything before it in the episode (so the
tokens trained on are the tokens sampled, in the context they were sampled in).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_offgrpo.data import ASSETS, Prompt, SamplingParams, chat
from megatron_offgrpo.envs import EnvironmentContractError, EnvironmentTimeout, Observation
from megatron_offgrpo.rollout import TransformersEngine
from megatron_offgrpo.rollout._episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from tests.helpers import qwen3_tokenizer_dir, turn_ending_model


class ScriptedEnv:
    """Answers turn k with a fixed observation (a tool's result, then feedback), done after ``steps`` steps, the
    reward counting its steps; records the turns it read."""

    tools = ()
    log: list[list[str]] = []  # every instance's turns, in creation order

    def __init__(self, steps: int = 3) -> None:
        self.steps, self.turns = steps, []
        ScriptedEnv.log.append(self.turns)

    def reset(self, prompt: Prompt) -> None:
        self.prompt = prompt

    def step(self, turn: str) -> Observation:
        self.turns.append(turn)
        k = len(self.turns)
        if k == self.steps:
            return Observation(reward=float(k), done=True)
        return Observation(f"result {k}", role="tool") if k % 2 else Observation(f"too low {k}", role="user")

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return turn_ending_model(tmp_path_factory.mktemp("episodes") / "model")


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3"])
def tokenizer(request, tmp_path_factory):
    if request.param == "qwen2.5":
        return AutoTokenizer.from_pretrained(ASSETS / "qwen2-tokenizer")
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = TransformersEngine(model_dir)
    yield eng
    eng.close()


def _prompts(tokenizer) -> list[Prompt]:
    texts = ["What is 2 + 3?", "What is 7 * 6?"]
    return [Prompt(f"p{i}", tuple(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True,
                                                                add_generation_prompt=True)["input_ids"]), t, "5")
            for i, t in enumerate(texts)]


def _hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def test_episodes_are_the_sampled_tokens(engine, tokenizer, model_dir):
    ScriptedEnv.log.clear()
    runner = EpisodeRunner(engine, ScriptedEnv, tokenizer, EpisodeLimits(max_turns=4, max_tokens=120))
    stats = EpisodeStats()
    prompts = _prompts(tokenizer)
    samples = runner.run(prompts, 3, SamplingParams(max_tokens=24, temperature=1.0, seed=11), stats)
    assert [s.group_id for s in samples] == [0, 0, 0, 1, 1, 1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tokenizer.eos_token_id
    for sample, turns in zip(samples, ScriptedEnv.log):
        assert sample.prompt_ids == list(prompts[sample.group_id].prompt_ids)
        assert sample.turns == len(turns) and sample.turns >= 1
        # walk the response: model turn (trainable, ends with EOS unless cut), then the observation (not trainable)
        ids, mask, at = sample.response_ids, sample.trainable, 0
        for k, text in enumerate(turns, start=1):
            end = ids.index(eos, at) + 1
            assert all(mask[at:end]) and tokenizer.decode(ids[at:end], skip_special_tokens=True) == text
            at = end
            if k < len(turns):  # the observation the environment gave after turn k, tokenised alone
                role, obs = ("tool", f"result {k}") if k % 2 else ("user", f"too low {k}")
                expected = chat.observation_ids(tokenizer, chat.turn_wrapping(tokenizer, role), obs)
                assert ids[at:at + len(expected)] == expected and not any(mask[at:at + len(expected)])
                at += len(expected)
        assert at == len(ids) or (sample.finish_reason == "length" and all(mask[at:]))
        assert sample.reward == (3.0 if len(turns) == 3 and sample.finish_reason == "stop" else 0.0)
        # each model token's behavior log-prob: the model's, given the whole episode before it
        reference = _hf_logprobs(model, sample.prompt_ids + ids)[len(sample.prompt_ids) - 1:]
        trained = torch.tensor(mask)
        got = torch.tensor(sample.behavior_logprobs, dtype=torch.float64)
        gap = (got[trained] - reference[trained]).abs().max()
        assert gap < 2e-4, gap
        assert (got[~trained] == 0).all()
    assert max(s.turns for s in samples) == 3  # the model ends its turns: episodes reach the environment's end
    assert stats.episodes == 6 and stats.turns == sum(s.turns for s in samples)


def test_the_token_budget_ends_an_episode(engine, tokenizer):
    """An observation that does not fit ends the episode as truncated; a turn is capped to what is left."""
    ScriptedEnv.log.clear()
    runner = EpisodeRunner(engine, ScriptedEnv, tokenizer, EpisodeLimits(max_turns=4, max_tokens=30))
    stats = EpisodeStats()
    samples = runner.run(_prompts(tokenizer)[:1], 4, SamplingParams(max_tokens=24, temperature=1.0, seed=3), stats)
    assert all(len(s.response_ids) <= 30 for s in samples)
    assert all(s.finish_reason == "length" for s in samples if s.reward == 0.0 and s.turns < 3)
    assert stats.truncated == sum(s.finish_reason == "length" for s in samples)


def test_max_turns_and_environment_failures(engine, tokenizer):
    """max_turns=1 is single-turn with the environment's reward; an environment that raises stops the call and
    every environment of it is closed."""
    made = []

    def make():
        made.append(ScriptedEnv(steps=1))
        return made[-1]

    runner = EpisodeRunner(engine, make, tokenizer, EpisodeLimits(max_turns=1, max_tokens=64))
    samples = runner.run(_prompts(tokenizer), 2, SamplingParams(max_tokens=16, temperature=1.0, seed=5))
    assert all(s.turns == 1 and s.trainable == [True] * len(s.response_ids) for s in samples)
    assert all(getattr(e, "closed", False) for e in made)

    class Broken(ScriptedEnv):
        def step(self, turn: str) -> Observation:
            raise RuntimeError("environment bug")

    made.clear()
    broken = EpisodeRunner(engine, lambda: made.append(Broken()) or made[-1], tokenizer, EpisodeLimits(2, 64))
    with pytest.raises(RuntimeError, match="environment bug"):
        broken.run(_prompts(tokenizer), 2, dataclasses.replace(SamplingParams(max_tokens=8), seed=1))
    assert len(made) == 4 and all(getattr(e, "closed", False) for e in made)


def test_the_first_turn_is_capped_by_the_episode_budget(engine, tokenizer):
    """A budget under one turn (env.max_tokens=3, turns of ~5 tokens, sampling's cap 24): the first turn is cut at
    the budget as every later one, so no episode is over it and the truncated count is the episodes cut."""
    ScriptedEnv.log.clear()
    stats = EpisodeStats()
    runner = EpisodeRunner(engine, ScriptedEnv, tokenizer, EpisodeLimits(max_turns=3, max_tokens=3))
    samples = runner.run(_prompts(tokenizer), 2, SamplingParams(max_tokens=24, temperature=1.0, seed=7), stats)
    assert all(len(s.response_ids) <= 3 and s.turns == 1 for s in samples)
    assert stats.truncated == sum(s.finish_reason == "length" for s in samples) == len(samples)  # nothing fits


def test_a_stuck_or_broken_environment_ends_the_call_named(engine, tokenizer):
    """A step that never returns ends the call at env.step_timeout_s naming the class and the method; the other
    environments are closed, the stuck one is not (its step is still running); a reset is bounded alike; a step
    that returns a dict or a NaN reward is one line naming what it returned."""
    release, made = threading.Event(), []

    class Stuck(ScriptedEnv):
        def step(self, turn: str) -> Observation:
            if self is made[1]:
                release.wait()
            return super().step(turn)

    def make(cls):
        def factory():
            made.append(cls())
            return made[-1]
        return factory

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2)
    try:
        runner = EpisodeRunner(engine, make(Stuck), tokenizer, EpisodeLimits(2, 64, call_timeout_s=0.5))
        with pytest.raises(EnvironmentTimeout, match=r"environment Stuck\.step did not return within 0\.5 s"):
            runner.run(_prompts(tokenizer)[:1], 3, params)
        assert [getattr(e, "closed", False) for e in made] == [True, False, True]

        class StuckReset(ScriptedEnv):
            def reset(self, prompt: Prompt) -> None:
                release.wait()

        made.clear()
        runner = EpisodeRunner(engine, make(StuckReset), tokenizer, EpisodeLimits(2, 64, call_timeout_s=0.3))
        with pytest.raises(EnvironmentTimeout, match=r"environment StuckReset\.reset did not return"):
            runner.run(_prompts(tokenizer)[:1], 2, params)
        assert len(made) == 1  # the second episode's environment was never made
    finally:
        release.set()
    for answer, named in [({"text": "too low"}, r"DictEnv\.step returned \{'text': 'too low'\} \(dict\)"),
                          (Observation("x", reward=math.nan),
                           r"DictEnv\.step returned an Observation with reward=nan")]:

        class DictEnv(ScriptedEnv):
            def step(self, turn: str, answer=answer):
                return answer

        made.clear()
        runner = EpisodeRunner(engine, make(DictEnv), tokenizer, EpisodeLimits(2, 64))
        with pytest.raises(EnvironmentContractError, match=named):
            runner.run(_prompts(tokenizer)[:1], 2, params)
        assert all(e.closed for e in made)
