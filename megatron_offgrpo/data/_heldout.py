"""Which questions are held out for evaluation: a fixed hash of the question's normalised text, never the seed or the
row order.

The same question is held out in every run, seed and recipe that holds the same set of questions (a warm-up and the
RL run after it agree without sharing state), and a question that a file repeats lands on one side only: training and
evaluation are disjoint by construction. "Repeats" counts variants that differ only in letter case, Unicode form
(NFKC: full-width digits, ligatures, non-breaking spaces) or whitespace: a training question's variant in evaluation
would measure memory, not generalisation.
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Iterable

HELD_OUT_FRACTION = 0.2
"""The share of distinct questions held out when a source has no evaluation set of its own (rounded, at least one)."""


def question_key(question: str) -> str:
    """What makes two questions the same one: NFKC-normalised, case-folded, whitespace runs collapsed to one space."""
    return " ".join(unicodedata.normalize("NFKC", question).casefold().split())


def _rank(question: str) -> bytes:
    """A question's place in the hash order: SHA-256 of its stripped text (as the split has always ranked it, so that
    a set without variants splits as it always did: the demo's held-out questions and figures stay what they were)."""
    return hashlib.sha256(question.strip().encode("utf-8")).digest()


def held_out_questions(questions: Iterable[str], fraction: float = HELD_OUT_FRACTION) -> set[str]:
    """The held-out share of the distinct ``questions`` (distinct by ``question_key``), as their keys: those whose
    hash ranks lowest, ``round(n x fraction)`` of them and at least one. The variants of one question are one
    question, ranked by the lowest hash among them, so they all land on one side. A question is held out when
    ``question_key(question)`` is in the set.

    Raises:
        ValueError: fewer than two distinct questions (nothing would be left to train on, or to evaluate).
    """
    ranks: dict[str, bytes] = {}
    for question in questions:
        key = question_key(question)
        ranks[key] = min(ranks.get(key, _rank(question)), _rank(question))
    if len(ranks) < 2:
        raise ValueError(f"{len(ranks)} distinct question(s): cannot hold some out for evaluation and train on "
                         "the rest")
    distinct = sorted(ranks, key=ranks.__getitem__)
    return set(distinct[: max(1, round(len(distinct) * fraction))])


def ordered_by_hash(questions: Iterable[str]) -> list[str]:
    """``questions`` in their hash order (the evaluation order of a held-out set: no seed, no row order)."""
    return sorted(questions, key=_rank)
