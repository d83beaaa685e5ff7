"""Labelled groups: the policy's completions of each prompt, sampled through the run's own engine
(``sampler.make_rollout_engine``, ``sampler.Rollouts``) and labelled by the rule reward (``data.reward``)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Sequence

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Prompt, QARecord, Sample, SamplingParams, rewards

logger = logging.getLogger(__name__)


class NoContrastError(RuntimeError):
    """The policy's training samples are all right or all wrong: there is nothing to tell apart."""


@dataclasses.dataclass
class LabelledGroup:
    """One prompt's G completions with their labels.

    Attributes:
        prompt_ids: [T_prompt] the prompt as the policy saw it. responses: G lists of [T_resp] sampled ids (EOS
            included where the completion stopped on it). rewards: [G] the rule reward. labels: [G] True where
            right (reward >= 1, the convention of ``offgrpo eval``'s pass@k).
    """

    prompt_id: str
    prompt_ids: tuple[int, ...]
    responses: list[list[int]]
    rewards: list[float]

    @property
    def labels(self) -> list[bool]:
        """[G] True where the completion is right (its rule reward >= 1)."""
        return [r >= 1.0 for r in self.rewards]

    @property
    def sequences(self) -> list[list[int]]:
        """[G] prompt + completion ids: what the classifier reads, and what RL's scoring feeds it."""
        return [[*self.prompt_ids, *response] for response in self.responses]


def distinct_records(records: Sequence[QARecord], limit: int | None) -> list[QARecord]:
    """The first ``limit`` records (None: all) of distinct questions, in order: a training stream repeats its
    questions (the demo's 2000 prompts are 80 questions), and a repeat would only weigh one question more."""
    seen, kept = set(), []
    for record in records:
        if record.question not in seen and (limit is None or len(kept) < limit):
            seen.add(record.question)
            kept.append(record)
    return kept


def label_groups(rollouts: Callable[[Sequence[Prompt], int, SamplingParams], list[Sample]], prompts: list[Prompt],
                 group_size: int, params: SamplingParams, per_call: int) -> list[LabelledGroup]:
    """``group_size`` rewarded completions of each prompt, ``per_call`` prompts per engine call, each call's seed
    ``params.seed`` plus its index (every call draws anew, and a rerun draws alike)."""
    groups = []
    for call, start in enumerate(range(0, len(prompts), per_call)):
        chunk = prompts[start:start + per_call]
        seed = None if params.seed is None else params.seed + call
        samples = rollouts(chunk, group_size, dataclasses.replace(params, seed=seed))
        for i, prompt in enumerate(chunk):
            mine = [s for s in samples if s.group_id == i]
            groups.append(LabelledGroup(prompt.prompt_id, tuple(prompt.prompt_ids),
                                        [list(s.response_ids) for s in mine], [float(s.reward) for s in mine]))
        done = sum(len(g.responses) for g in groups)
        logger.info("sampled %d completions of %d prompts", done, len(groups))
    return groups


def check_contrast(groups: Sequence[LabelledGroup], policy: str) -> None:
    """Refuse training samples that are all right or all wrong (``NoContrastError``, naming the counts)."""
    labels = [y for g in groups for y in g.labels]
    if all(labels) or not any(labels):
        kind = "right" if all(labels) else "wrong"
        raise NoContrastError(
            f"all {len(labels)} training completions of {policy} are {kind} (data.reward): a reward model learns "
            "from both kinds; sample more (rm.prompts, rollout.group_size), at a higher rollout.temperature, or "
            "from a policy that is sometimes right and sometimes wrong (offgrpo sft first)")


def sample_labelled(config: Config, model_dir: Path) -> tuple[list[LabelledGroup], list[LabelledGroup], dict]:
    """(training groups, held-out groups, the data report) of the policy in ``model_dir``: the first ``rm.prompts``
    distinct training questions and the first ``train.eval_prompts`` of the eval split, ``rollout.group_size``
    completions each at ``rollout.temperature``, seeded by ``parallel.seed``."""
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.sampler import Rollouts, build_prompts, load_data, log_data, make_rollout_engine

    tokenizer = load_tokenizer(model_dir)
    data = load_data(config)
    report = log_data(config, data)
    train = build_prompts(config, tokenizer, distinct_records(data.train, config.rm.prompts))
    heldout = build_prompts(config, tokenizer, data.eval[: config.train.eval_prompts])
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    r = config.rollout
    params = SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                            seed=config.parallel.seed)
    engine = make_rollout_engine(config, model_dir, None, positions)
    try:
        rollouts = Rollouts.build(config, engine, tokenizer, rewards.get_reward(config.data.reward))
        # the run's batch per engine call: what the engine is sized for (its sequences at once)
        train_groups = label_groups(rollouts, train, r.group_size, params, r.prompts_per_step)
        heldout_params = dataclasses.replace(params, seed=config.parallel.seed + len(train))  # draws of their own
        heldout_groups = label_groups(rollouts, heldout, r.group_size, heldout_params, r.prompts_per_step)
    finally:
        engine.close()
    return train_groups, heldout_groups, report
