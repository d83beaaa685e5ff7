"""A Python tool for math word problems: the model may call ``python`` (a sandboxed run of its code) before it
answers; the episode's reward is the task's reward of its final answer.

The call format is the one Qwen2.5's and Qwen3's chat templates teach (their ``tools=`` system prompt):
``<tool_call>\\n{"name": "python", "arguments": {"code": "..."}}\\n</tool_call>``. A turn without a tool call is the
answer. A malformed call, an unknown tool, or code that fails or hits a sandbox limit is answered with a tool error the
model reads, and the episode goes on.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from megatron_offgrpo.data import Prompt
from megatron_offgrpo.envs._protocol import Observation, ToolSpec
from megatron_offgrpo.envs._sandbox import SandboxLimits, run_python

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PYTHON_TOOL = ToolSpec(
    "python",
    "Run Python code and return what it prints (standard library only; a few seconds and a little memory).",
    {"type": "object", "properties": {"code": {"type": "string", "description": "the code; print the results"}},
     "required": ["code"]},
)


def parse_tool_call(turn: str) -> tuple[str | None, str | None]:
    """``(code, error)`` of the first ``<tool_call>`` of a turn: ``(None, None)`` without a call; an error line for
    a call that is not ``{"name": "python", "arguments": {"code": str}}``."""
    match = _TOOL_CALL.search(turn)
    if match is None:
        return None, None
    try:
        call = json.loads(match.group(1).strip())
    except json.JSONDecodeError as exc:
        return None, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(call, dict) or call.get("name") != PYTHON_TOOL.name:
        name = call.get("name") if isinstance(call, dict) else None
        return None, f"unknown tool {name!r}: the only tool is {PYTHON_TOOL.name!r}"
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return None, 'the python tool takes {"code": "<the code>"}'
    return code, None


class PythonToolEnv:
    """GSM8K-style problems with a sandboxed Python tool (``env.name=python_tool``)."""

    tools = (PYTHON_TOOL,)

    def __init__(self, reward_fn: Callable[[str, str | None], float], limits: SandboxLimits | None = None) -> None:
        """Args: reward_fn: the task's reward of the final answer (``data.reward``). limits: each tool run's."""
        self.reward_fn, self.limits = reward_fn, limits or SandboxLimits()
        self.answer: str | None = None

    def reset(self, prompt: Prompt) -> None:
        self.answer = prompt.answer

    def step(self, turn: str) -> Observation:
        code, error = parse_tool_call(turn)
        if error is not None:
            return Observation(f"error: {error}", role="tool", tool_error=True)
        if code is None:  # no call: this turn is the answer
            return Observation(reward=float(self.reward_fn(turn, self.answer)), done=True)
        result = run_python(code, self.limits)
        return Observation(result.for_model(), role="tool", tool_error=result.error is not None)

    def close(self) -> None:
        pass  # each tool run's process and scratch directory are gone when run_python returns
