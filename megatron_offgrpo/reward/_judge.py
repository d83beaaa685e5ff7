"""A generative judge: the completion goes into the judge's template as data, the judge replies, the verdict its
reply begins with is the score (``_template``: why the policy's text cannot write the verdict)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from typing import Literal, Protocol, Sequence

from megatron_offgrpo.reward._template import JudgeTemplate, parse_verdict, verdict_tokens
from megatron_offgrpo.reward._types import ModelScore, ScoreRequest

logger = logging.getLogger(__name__)
TOP_LOGPROBS = 20
"""First-token candidates asked of the judge for the soft score (vLLM's default cap on log-probs is 20)."""
RESAMPLE_TEMPERATURE = 1.0
"""A retry after an unparsed greedy reply samples at this temperature (a greedy retry would repeat the reply)."""


class JudgeModel(Protocol):
    """What replies: ``LocalJudgeModel`` in process or ``FleetJudgeModel`` over a fleet's servers."""

    name: str

    def reply(self, prompt_ids: list[int], max_tokens: int, temperature: float, seed: int,
              top: int) -> tuple[list[int], dict[int, float]]:
        """The reply's token ids and the first token's ``top`` candidates' log-probs."""
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
    """A ``Scorer`` over a judge model; ``parallel`` requests at once (a fleet's servers answer concurrently)."""

    def __init__(self, model: JudgeModel, tokenizer, settings: JudgeSettings, parallel: int = 1) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.yes, self.no = verdict_tokens(tokenizer, settings.template.kind)
        self._pool = concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix="offgrpo-judge")

    def score(self, requests: Sequence[ScoreRequest]) -> list[ModelScore]:
        return list(self._pool.map(self.score_one, requests))

    def prompt_ids(self, request: ScoreRequest) -> list[int]:
        """The judge's prompt: the rendered template as a user turn of the judge's chat template (a model without
        one reads the text as it is)."""
        text = self.settings.template.render(request.question, request.response_text, request.reference)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def score_one(self, request: ScoreRequest) -> ModelScore:
        """Ask the judge (again, with another seed, under ``unparsed=resample``) until its reply begins with a
        verdict; a reply without one scores 0 and is counted (``ModelScore.parsed``)."""
        s = self.settings
        prompt, tries = self.prompt_ids(request), s.attempts if s.unparsed == "resample" else 1
        reply = ""
        for attempt in range(tries):
            temperature = s.temperature if attempt == 0 else max(s.temperature, RESAMPLE_TEMPERATURE)
            tokens, first = self.model.reply(prompt, s.max_tokens, temperature, request.seed + attempt, TOP_LOGPROBS)
            reply = self.tokenizer.decode(tokens, skip_special_tokens=True)
            verdict = parse_verdict(reply, s.template.kind)
            if verdict is not None:
                if s.soft and tokens and tokens[0] in self.yes | self.no:
                    verdict = self._soft(first, verdict)
                return ModelScore(verdict, True, attempt + 1, reply)
        return ModelScore(0.0, False, tries, reply)

    def _soft(self, first: dict[int, float], hard: float) -> float:
        """P(yes) / (P(yes) + P(no)) over the first token's candidates (the hard verdict when neither is among
        them, which a reply beginning with one of them makes rare)."""
        p_yes = sum(math.exp(lp) for token, lp in first.items() if token in self.yes)
        p_no = sum(math.exp(lp) for token, lp in first.items() if token in self.no)
        return p_yes / (p_yes + p_no) if p_yes + p_no > 0 else hard

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.model.close()
