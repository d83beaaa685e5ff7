"""Accuracy of the engine's current weights on a prompt set: greedy (one completion per prompt), and with
``samples`` n > 1 also pass@k and avg@n over n sampled completions per prompt."""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_offgrpo.data import Prompt, Sample, SamplingParams

EVAL_BATCH = 64
"""Prompts per engine call of an evaluation (one greedy sample each)."""


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which ``correct`` are right (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``, the chance that k of the n samples drawn
    without replacement hold at least one right answer; as a product, so no binomial overflows."""
    if not 1 <= k <= n or not 0 <= correct <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= correct <= n; got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    miss = 1.0
    for i in range(n - correct + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_ks(n: int) -> list[int]:
    """The k a sampled evaluation reports: the powers of two below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def _task_score(sample: Sample) -> float:
    """The rule's reward (gold) beside a reward model, else the reward: accuracy is the task's, not the model's."""
    return sample.gold_reward if sample.gold_reward is not None else sample.reward


def evaluate(rollouts: Callable[[Sequence[Prompt], int, SamplingParams], list[Sample]], prompts: Sequence[Prompt],
             max_new_tokens: int, batch: int = EVAL_BATCH, samples: int = 1, temperature: float = 1.0,
             seed: int = 0) -> dict[str, float]:
    """Greedy accuracy (mean reward; the rule's beside a reward model) and mean response length over ``prompts``;
    with ``samples`` n > 1 also ``eval_pass@k`` (k in ``pass_ks(n)``; a completion is right when its reward is >= 1)
    and ``eval_avg@n`` (the mean reward of the n completions) sampled at ``temperature`` with a fixed ``seed`` (every
    evaluation of a run draws alike, so its points compare); beside a reward model also ``eval_reward_model``, its
    mean score of the greedy completions.

    Args:
        rollouts: prompts, n, sampling -> n rewarded samples per prompt (``sampler._generate.Rollouts``: completions
            scored by the task's reward, or multi-turn episodes rewarded by their environment).
    """
    greedy = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    rewards, lengths, right, sampled, scores = [], [], [], [], []
    for start in range(0, len(prompts), batch):
        for sample in rollouts(list(prompts[start:start + batch]), 1, greedy):
            rewards.append(_task_score(sample))
            lengths.append(len(sample.response_ids))
            if sample.model_score is not None:
                scores.append(sample.model_score)
    if samples > 1:
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed)
        per_call = max(1, batch // samples)
        for start in range(0, len(prompts), per_call):
            chunk = list(prompts[start:start + per_call])
            group_rewards = [_task_score(s) for s in rollouts(chunk, samples, params)]
            for i in range(len(chunk)):
                mine = group_rewards[i * samples:(i + 1) * samples]
                right.append(sum(r >= 1.0 for r in mine))
                sampled.append(sum(mine) / samples)
    n = max(len(rewards), 1)
    result = {"eval_accuracy": sum(rewards) / n, "eval_response_len": sum(lengths) / n, "eval_prompts": len(rewards)}
    if scores:  # beside a reward model: its mean score of the greedy completions, against the gold accuracy above
        result["eval_reward_model"] = sum(scores) / len(scores)
    if right:
        for k in pass_ks(samples):
            result[f"eval_pass@{k}"] = sum(pass_at_k(samples, c, k) for c in right) / len(right)
        result[f"eval_avg@{samples}"] = sum(sampled) / len(sampled)
    return result
