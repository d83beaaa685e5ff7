"""Verifiable rewards: answer extraction for math word problems and a registry of reward functions.

A reward function takes the completion text and the prompt's ground truth and returns a float. Register new ones
with ``@register_reward("name")``; ``get_reward`` lists the valid names on a miss.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation, localcontext
from typing import Callable

RewardFn = Callable[[str, "str | None"], float]
_REWARDS: dict[str, RewardFn] = {}

_NUMBER = r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+"
_HASH_ANSWER = re.compile(r"####\s*(" + _NUMBER + r")")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*\**\s*(" + _NUMBER + r")", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUMBER)
_NOT_FINITE = re.compile(r"\d\s*[eE][+-]?\d|\b(?:inf(?:inity)?|nan)\b", re.IGNORECASE)
MAX_ANSWER_DIGITS = 100
"""The longest ground truth the math rewards accept: no completion of a sane length writes a longer number, and
past Python's 4300-digit limit (sys.get_int_max_str_digits) int() raises in whoever reads it."""


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register ``fn`` as the reward ``name`` (a decorator)."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        _REWARDS[name] = fn
        return fn

    return decorator


def import_dotted(path: str, key: str):
    """The object ``"package.module:name"`` names (a user's reward, environment, ...).

    Raises:
        ValueError: naming ``key`` and the path when the module or the name cannot be imported.
    """
    import importlib

    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}={path!r}: cannot import {attr!r} from {module!r} ({exc})") from None


def get_reward(name: str) -> RewardFn:
    """The reward function registered as ``name``, or ``"package.module:function"`` for your own.

    A custom reward is any callable ``(completion_text, ground_truth) -> float``; it is imported on every rank
    that scores, so its module must be importable there.

    Raises:
        ValueError: listing the registered names when ``name`` is neither registered nor importable.
    """
    if ":" in name:
        fn = import_dotted(name, "reward")
        if not callable(fn):
            raise ValueError(f"reward={name!r} is not callable")
        return fn
    if name not in _REWARDS:
        raise ValueError(f"reward={name!r} is not registered; valid: {sorted(_REWARDS)} or 'package.module:function'")
    return _REWARDS[name]


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` (balanced braces), in order."""
    out = []
    for match in re.finditer(r"\\boxed\s*\{", text):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                out.append(text[start:pos])
                break
    return out


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number written with $, commas, spaces or trailing zeros ("1,000.50" ->
    "1000.5"); None when ``text`` holds no number."""
    match = _ANY_NUMBER.search(text.replace("{,}", ",").replace("\\,", "").replace("\\!", ""))
    if match is None:
        return None
    raw = re.sub(r"[\s$,]", "", match.group(0))
    try:
        value = Decimal(raw)
    except InvalidOperation:
        return None
    # a sampled completion may hold any digit string: with Decimal's default 28 digits, normalize() would round
    # a longer number (two different answers would compare equal) and quantize() would raise
    with localcontext() as ctx:
        ctx.prec = max(ctx.prec, len(raw) + 1)
        value = value.normalize()
        if value == value.to_integral():
            value = value.quantize(Decimal(1))  # "1E+2" -> "100"
    return format(value, "f")


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a completion, normalised; None when there is none.

    Precedence: the last ``\\boxed{}``, then the last ``#### N`` (GSM8K's own format), then "the answer is N",
    then the last number in the text.
    """
    for candidates in (_boxed_contents(text), _HASH_ANSWER.findall(text), _ANSWER_IS.findall(text)):
        for candidate in reversed(candidates):
            number = normalize_number(candidate)
            if number is not None:
                return number
    numbers = _ANY_NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def answer_error(answer: str) -> str | None:
    """Why the ground truth ``answer`` cannot be scored by the math rewards (no number, not finite: "inf", "nan",
    "1e999", whose digits the reward would read as 1; or more than ``MAX_ANSWER_DIGITS`` digits); None when it can.
    Only the final answer is read: the text after the last ``####`` when there is one (GSM8K's worked solutions)."""
    final = answer.rsplit("####", 1)[-1]
    shown = repr(final.strip()) if len(final.strip()) <= 40 else f"{final.strip()[:20]!r}..."
    if _NOT_FINITE.search(final):
        return f"the answer {shown} is not a finite number"
    number = extract_answer(answer)
    if number is None:
        return f"the answer {shown} holds no number"
    digits = sum(c.isdigit() for c in number)
    if digits > MAX_ANSWER_DIGITS:
        return f"the answer has {digits} digits (at most {MAX_ANSWER_DIGITS})"
    return None


@register_reward("math_exact")
def math_exact_reward(completion: str, answer: str | None) -> float:
    """1.0 when the completion's final number equals the ground truth's (GSM8K's ``#### N`` or a bare number)."""
    if answer is None:
        raise ValueError("math_exact needs the ground-truth answer (Prompt.answer is None)")
    truth = extract_answer(answer)
    if truth is None:
        raise ValueError(f"ground truth {answer!r} holds no number")
    return 1.0 if extract_answer(completion) == truth else 0.0


@register_reward("math_strict")
def math_strict_reward(completion: str, answer: str | None) -> float:
    """Like ``math_exact`` but only an explicit ``\\boxed{}`` or ``#### N`` answer counts (no last-number fallback)."""
    if answer is None:
        raise ValueError("math_strict needs the ground-truth answer (Prompt.answer is None)")
    explicit = _boxed_contents(completion) + _HASH_ANSWER.findall(completion)
    if not explicit:
        return 0.0
    return 1.0 if normalize_number(explicit[-1]) == extract_answer(answer) else 0.0
