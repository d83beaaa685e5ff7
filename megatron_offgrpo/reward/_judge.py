"""A generative judge: the completion goes into the judge's template as data, the judge replies, the verdict its
reply begins with is the score (``_template``: why the policy's text cannot write the verdict)."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal, Protocol, Sequence

from megatron_offgrpo.reward._template import JudgeTemplate, parse_verdict, verdict_tokens
from megatron_offgrpo.reward._types import ModelScore, ScoreRequest

logger = logging.getLogger(__name__)
Reply = tuple[list[int], dict[int, float]]
"""A judge's reply: its token ids, and its first token's most likely candidates (token id -> log-prob)."""
TOP_LOGPROBS = 20
"""First-token candidates asked of the judge for the soft score (vLLM's default cap on log-probs is 20)."""
RESAMPLE_TEMPERATURE = 1.0
"""A retry after an unparsed greedy reply samples at this temperature (a greedy retry would repeat the reply)."""


class JudgeModel(Protocol):
    """What replies: ``LocalJudgeModel`` in process or ``FleetJudgeModel`` over a fleet's servers."""

    name: str

    def replies(self, prompts: Sequence[list[int]], max_tokens: int, temperature: float, seeds: Sequence[int],
                top: int) -> list[Reply]:
        """One reply per prompt (prompt k sampled with ``seeds[k]`` when ``temperature`` > 0), each with its first
        token's ``top`` candidates."""
        ...

    def close(self) -> None:
        ...


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """The judge's ``reward.*`` keys: the template, the reply's length and temperature, what an unparsed reply
    scores and how often a sample is asked again, and whether a yes/no verdict is read softly."""

    template: JudgeTemplate
    max_tokens: int = 8
    temperature: float = 0.0
    unparsed: Literal["zero", "resample"] = "zero"
    attempts: int = 3
    soft: bool = True


class Judge:
    """A ``Scorer`` over a judge model: a group's prompts are asked at once (a batch in process, concurrent
    requests on a fleet)."""

    def __init__(self, model: JudgeModel, tokenizer, settings: JudgeSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.yes, self.no = verdict_tokens(tokenizer, settings.template.kind)

    def prompt_ids(self, request: ScoreRequest) -> list[int]:
        """The judge's prompt: the rendered template as a user turn of the judge's chat template (a model without
        one reads the text as it is)."""
        text = self.settings.template.render(request.question, request.response_text, request.reference)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def score(self, requests: Sequence[ScoreRequest]) -> list[ModelScore]:
        """Ask the judge; under ``unparsed=resample`` ask again (another seed, sampled) those whose reply began with
        no verdict, up to ``attempts`` replies each; a reply without one scores 0 and is counted
        (``ModelScore.parsed``)."""
        s = self.settings
        prompts = [self.prompt_ids(r) for r in requests]
        scores: list[ModelScore | None] = [None] * len(requests)
        last: list[str] = [""] * len(requests)
        pending = list(range(len(requests)))
        tries = s.attempts if s.unparsed == "resample" else 1
        for attempt in range(tries):
            temperature = s.temperature if attempt == 0 else max(s.temperature, RESAMPLE_TEMPERATURE)
            replies = self.model.replies([prompts[k] for k in pending], s.max_tokens, temperature,
                                         [requests[k].seed + attempt for k in pending], TOP_LOGPROBS)
            left = []
            for k, (tokens, first) in zip(pending, replies):
                last[k] = self.tokenizer.decode(tokens, skip_special_tokens=True)
                verdict = parse_verdict(last[k], s.template.kind)
                if verdict is None:
                    left.append(k)
                    continue
                if s.soft and tokens and tokens[0] in self.yes | self.no:
                    verdict = self._soft(first, verdict)
                scores[k] = ModelScore(verdict, True, attempt + 1, last[k])
            pending = left
            if not pending:
                break
        return [score if score is not None else ModelScore(0.0, False, tries, last[k])
                for k, score in enumerate(scores)]

    def _soft(self, first: dict[int, float], hard: float) -> float:
        """P(yes) / (P(yes) + P(no)) over the first token's candidates (the hard verdict when neither is among
        them, which a reply beginning with one of them makes rare)."""
        p_yes = sum(math.exp(lp) for token, lp in first.items() if token in self.yes)
        p_no = sum(math.exp(lp) for token, lp in first.items() if token in self.no)
        return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else hard

    def close(self) -> None:
        self.model.close()
