"""A feedback environment: the model answers, and is told "too low", "too high" or "wrong" and may try again.

The reward of a right answer falls with the turn it came in (``decay ** (turn - 1)``: 1, 0.5, 0.25, ... by default),
so an episode that is right at once scores more than one that needed the hints; a wrong last answer scores 0.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Callable

from megatron_offgrpo.data import Prompt, rewards
from megatron_offgrpo.envs._protocol import Observation


def _number(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        return Decimal(rewards.normalize_number(text))
    except (InvalidOperation, ValueError, TypeError):
        return None


class FeedbackEnv:
    """Answer, hear how far off, answer again (``env.name=feedback``)."""

    tools = ()

    def __init__(self, reward_fn: Callable[[str, str | None], float], decay: float = 0.5) -> None:
        """Args: reward_fn: whether an answer is right (``data.reward``; 1 = right). decay: a right answer's reward
        is ``decay ** (turn - 1)``."""
        if not 0 < decay <= 1:
            raise ValueError(f"feedback decay={decay}: must be in (0, 1]")
        self.reward_fn, self.decay = reward_fn, decay
        self.answer: str | None = None
        self.turn = 0

    def reset(self, prompt: Prompt) -> None:
        self.answer, self.turn = prompt.answer, 0

    def step(self, turn: str) -> Observation:
        self.turn += 1
        if self.reward_fn(turn, self.answer) >= 1.0:
            return Observation(reward=self.decay ** (self.turn - 1), done=True)
        given, truth = _number(rewards.extract_answer(turn)), _number(self.answer)
        if given is None:
            hint = "I found no answer. Give the final number after '####'."
        elif truth is None or given == truth:  # a right number the reward refuses (its format)
            hint = "Wrong, try again."
        else:
            hint = f"{given} is too {'low' if given < truth else 'high'}. Try again."
        return Observation(hint, role="user")

    def close(self) -> None:
        pass
