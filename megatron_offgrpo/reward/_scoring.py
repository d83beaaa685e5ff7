"""The run's reward model: which one (``RewardSpec``), where it runs, and a group's rewards from its scores."""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal, Sequence

from megatron_offgrpo.data import Prompt, Sample
from megatron_offgrpo.reward._combine import RewardMix
from megatron_offgrpo.reward._judge import Judge, JudgeSettings
from megatron_offgrpo.reward._types import ModelScore, Scorer, ScoreRequest, request_seed

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """A reward model, from the ``reward.*`` keys (``sampler`` builds it).

    Attributes:
        kind: "classifier" (a scalar reward model) or "judge". path: its HF directory or hub id (the trainer reads
            its config and tokenizer even when a fleet serves it). fleet: the fleet's state directory, or None for
            rank 0's process. judge: the judge's settings (kind "judge"). mix: how scores and rule rewards mix.
        seed: the run's seed (a judge's per-completion seeds derive from it). timeout_s: one request's bound on a
            fleet server. parallel: requests in flight at once on a fleet.
    """

    kind: Literal["classifier", "judge"]
    path: str
    fleet: str | None = None
    judge: JudgeSettings | None = None
    mix: RewardMix = RewardMix()
    seed: int = 0
    timeout_s: float = 120.0
    parallel: int = 32

    def __post_init__(self) -> None:
        if (self.kind == "judge") != (self.judge is not None):
            raise ValueError(f"RewardSpec(kind={self.kind!r}): judge settings go with a judge, and only with one")


class RewardModel:
    """Scores groups of completions and sets their rewards (thread-safe: groups are scored as they finish).

    Args:
        pad_id: a classifier's ``pad_token_id``: trailing ones are cut from what it reads. HF's classifiers pool
            the last token that is not padding (how a reward model was trained), vLLM's pooler the last token: a
            Qwen completion ending in ``<|endoftext|>`` (Qwen's pad) is read at the token before it by both.
    """

    def __init__(self, scorer: Scorer, mix: RewardMix, seed: int, pad_id: int | None = None) -> None:
        self.scorer, self.mix, self.seed, self.pad_id = scorer, mix, seed, pad_id
        self._warned = False

    @classmethod
    def open(cls, spec: RewardSpec) -> RewardModel:
        """Load the model in process, or connect to its fleet (``FleetError`` when no server answers)."""
        import transformers

        scorer: Scorer
        pad_id = None
        if spec.kind == "classifier":
            pad_id = transformers.AutoConfig.from_pretrained(spec.path).pad_token_id
            if spec.fleet is None:
                from megatron_offgrpo.reward._local import LocalClassifier

                scorer = LocalClassifier(spec.path)
            else:
                from megatron_offgrpo.reward._fleet import FleetClassifier

                scorer = FleetClassifier.from_state(spec.fleet, spec.timeout_s, spec.parallel)
        else:
            tokenizer = transformers.AutoTokenizer.from_pretrained(spec.path)
            if spec.fleet is None:
                from megatron_offgrpo.reward._local import LocalJudgeModel

                scorer = Judge(LocalJudgeModel(spec.path), tokenizer, spec.judge)
            else:
                from megatron_offgrpo.reward._fleet import FleetJudgeModel

                scorer = Judge(FleetJudgeModel.from_state(spec.fleet, spec.timeout_s, spec.parallel), tokenizer,
                               spec.judge)
        return cls(scorer, spec.mix, spec.seed, pad_id)

    def score_group(self, prompt: Prompt, samples: Sequence[Sample], texts: Sequence[str],
                    rule: Sequence[float]) -> list[ModelScore]:
        """Score one group (the samples of ``prompt``, their decoded ``texts``) and set each sample's
        ``model_score`` and ``reward`` (the mix of its ``rule`` reward and the shaped score)."""
        requests = [ScoreRequest(prompt.text, prompt.answer, self._read(s), text,
                                 request_seed(self.seed, s.prompt_id, s.response_ids))
                    for s, text in zip(samples, texts, strict=True)]
        scores = self.scorer.score(requests)
        unparsed = [score for score in scores if not score.parsed]
        if unparsed and not self._warned:  # once: the metric counts the rest (reward_model_unparsed)
            self._warned = True
            logger.warning("reward.judge: %d of %d replies held no verdict (scored 0 after %d tries), e.g. %r; "
                           "counted as reward_model_unparsed from now on", len(unparsed), len(scores),
                           unparsed[0].attempts, unparsed[0].reply[:200])
        for sample, score, reward in zip(samples, scores, self.mix.rewards(rule, [s.value for s in scores])):
            sample.model_score, sample.model_parsed, sample.reward = score.value, score.parsed, reward
        return scores

    def _read(self, sample: Sample) -> tuple[int, ...]:
        """The tokens a classifier reads: prompt and response, without trailing padding."""
        ids = (*sample.prompt_ids, *sample.response_ids)
        end = len(ids)
        while end > 1 and self.pad_id is not None and ids[end - 1] == self.pad_id:
            end -= 1
        return ids[:end]

    def close(self) -> None:
        self.scorer.close()
