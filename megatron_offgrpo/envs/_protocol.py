"""The environment a multi-turn episode talks to: reset with a prompt, then one ``step`` per model turn.

Token in / token out: the episode runner (``rollout``) never re-encodes the model's tokens. It decodes a turn only to
hand its text to ``step``; the observation's text is tokenised alone (wrapped in the chat template's turn markers
for its ``role``) and appended after the exact tokens sampled so far.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from megatron_offgrpo.data import Prompt

ROLES = ("tool", "user")


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the environment answers to one model turn.

    Attributes:
        text: the environment's message to the model (a tool's output, feedback); ignored when ``done``.
        role: how the chat template wraps it: "tool" (Qwen: ``<tool_response>`` inside a user turn) or "user".
        reward: this step's reward; an episode's reward is the sum over its steps.
        done: True ends the episode (no further turn is generated).
        tool_error: True when a tool call failed (a bad call, a sandbox limit hit): counted in the metrics; the
            model still sees ``text``, which says what went wrong.
    """

    text: str = ""
    role: str = "user"
    reward: float = 0.0
    done: bool = False
    tool_error: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"observation role {self.role!r}: expected one of {list(ROLES)}")


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """One tool the model may call, as the chat template's ``tools=`` argument shows it (OpenAI function format).

    Attributes:
        name: the function name the model writes in ``<tool_call>``. description: one line for the model.
        parameters: the JSON schema of its arguments (``{"type": "object", "properties": ..., "required": ...}``).
    """

    name: str
    description: str
    parameters: dict

    def as_template_tool(self) -> dict:
        """The ``{"type": "function", "function": {...}}`` entry chat templates render into the system prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@runtime_checkable
class Environment(Protocol):
    """One episode's environment; a fresh instance per episode (the runner calls the factory G times per prompt).

    ``step`` may be called from a worker thread (episodes of a step run concurrently); an instance is only ever used
    by one episode, so it needs no locking of its own.
    """

    tools: tuple[ToolSpec, ...]
    """The tools the prompt announces (empty: none; the prompt is built without ``tools=``)."""

    def reset(self, prompt: Prompt) -> None:
        """Start an episode on ``prompt`` (its question and ground truth)."""
        ...

    def step(self, turn: str) -> Observation:
        """The model's turn (its text, special tokens removed) -> the environment's answer."""
        ...

    def close(self) -> None:
        """Release what the episode holds (processes, files); called once, also after a failure."""
        ...
