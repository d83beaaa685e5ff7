"""What a reward model is asked and what it answers: one completion in, one score out, typed on both sides."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Protocol, Sequence


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """One completion to score.

    Attributes:
        question: the prompt's raw question (a judge's ``{question}``). reference: its ground truth, if any.
        token_ids: the policy's prompt and response tokens (a scalar reward model reads these, at the policy's ids).
        response_text: the response decoded (a judge's ``{response}``).
        seed: the judge's sampling seed for this completion (``request_seed``): the same completion, the same reply.
    """

    question: str
    reference: str | None
    token_ids: tuple[int, ...]
    response_text: str
    seed: int


@dataclasses.dataclass(frozen=True)
class ModelScore:
    """A reward model's answer for one completion.

    Attributes:
        value: the score (a classifier's logit; a judge's verdict in [0, 1], 0 when it gave none).
        parsed: False when a judge's replies held no verdict (``reward.unparsed`` decided ``value``).
        attempts: replies asked of the judge (1 for a classifier). reply: the judge's last reply (for the logs).
        server: the fleet server that answered ("" in process).
    """

    value: float
    parsed: bool = True
    attempts: int = 1
    reply: str = ""
    server: str = ""


class Scorer(Protocol):
    """Scores completions: a classifier or a judge, in process or on a fleet. Thread-safe: groups are scored from
    several threads at once."""

    def score(self, requests: Sequence[ScoreRequest]) -> list[ModelScore]:
        """One score per request, in order. Raises ``RewardModelError`` when one cannot be had."""
        ...

    def close(self) -> None:
        """Release threads and models."""
        ...


class RewardModelError(RuntimeError):
    """A completion no server or model could score (one line: which, and why)."""


def request_seed(seed: int, prompt_id: str, response_ids: Sequence[int]) -> int:
    """A 31-bit seed from the run's seed, the prompt and the response's tokens: a completion sampled twice (or
    scored again after a resume) gets the same judge reply."""
    body = ",".join(map(str, response_ids))
    return zlib.crc32(f"{seed}/{prompt_id}/{body}".encode()) & 0x7FFFFFFF
