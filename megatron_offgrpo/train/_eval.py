"""Accuracy of the engine's current weights on a prompt set (greedy, one sample per prompt)."""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_offgrpo.data import Prompt, SamplingParams

EVAL_BATCH = 64
"""Prompts per engine call of an evaluation (one greedy sample each)."""


def evaluate(engine, prompts: Sequence[Prompt], reward_fn: Callable[[str, str | None], float], tokenizer,
             max_new_tokens: int, batch: int = EVAL_BATCH) -> dict[str, float]:
    """Greedy accuracy (mean reward) and mean response length over ``prompts``."""
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    rewards, lengths = [], []
    for start in range(0, len(prompts), batch):
        chunk = list(prompts[start:start + batch])
        for sample, prompt in zip(engine.generate(chunk, 1, params), chunk):
            text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            rewards.append(reward_fn(text, prompt.answer))
            lengths.append(len(sample.response_ids))
    n = max(len(rewards), 1)
    return {"eval_accuracy": sum(rewards) / n, "eval_response_len": sum(lengths) / n, "eval_prompts": len(rewards)}
