"""The shipped environments and the registry: what the model reads back, the rewards, one-line errors."""

from __future__ import annotations

import json

import pytest

from megatron_offgrpo.data import Prompt, get_reward
from megatron_offgrpo.envs import (
    Environment,
    FeedbackEnv,
    Observation,
    PythonToolEnv,
    SandboxLimits,
    environment_factory,
    environment_tools,
    parse_tool_call,
)

REWARD = get_reward("math_exact")
PROMPT = Prompt("q0", (1, 2, 3), "What is 17 * 23?", "391")


def _call(body: str) -> str:
    return f"Let me compute.\n<tool_call>\n{body}\n</tool_call>"


@pytest.mark.parametrize(("turn", "code", "error"), [
    ("#### 391", None, None),
    (_call('{"name": "python", "arguments": {"code": "print(17 * 23)"}}'), "print(17 * 23)", None),
    (_call('{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}'), "print(1)", None),
    (_call('{"name": "python", "arguments": {"code": '), None, "not valid JSON"),
    (_call('{"name": "shell", "arguments": {"cmd": "ls"}}'), None, "unknown tool 'shell'"),
    (_call('{"name": "python", "arguments": {"source": "1"}}'), None, '{"code"'),
])
def test_tool_calls_are_parsed_or_named_wrong(turn, code, error):
    got_code, got_error = parse_tool_call(turn)
    assert got_code == code
    assert (got_error is None) if error is None else (error in got_error)


def test_python_tool_episode():
    env = PythonToolEnv(REWARD)
    assert isinstance(env, Environment) and env.tools[0].name == "python"
    env.reset(PROMPT)
    ran = env.step(_call('{"name": "python", "arguments": {"code": "print(17 * 23)"}}'))
    assert ran == Observation("391\n", role="tool") or (ran.role == "tool" and ran.text.strip() == "391"
                                                        and not ran.done and not ran.tool_error)
    bad = env.step(_call('{"name": "python", "arguments": {"code": "1/0"}}'))
    assert bad.tool_error and "ZeroDivisionError" in bad.text and not bad.done
    malformed = env.step(_call("{not json"))
    assert malformed.tool_error and malformed.text.startswith("error: the tool call is not valid JSON")
    answer = env.step("So the product is #### 391")
    assert answer.done and answer.reward == 1.0
    env.close()


def test_python_tool_limits_reach_the_model():
    env = PythonToolEnv(REWARD, SandboxLimits(cpu_seconds=1, wall_seconds=3))
    env.reset(PROMPT)
    spin = env.step(_call('{"name": "python", "arguments": {"code": "while True: pass"}}'))
    assert spin.tool_error and not spin.done and "limit" in spin.text or "timed out" in spin.text


def test_feedback_episode():
    env = FeedbackEnv(REWARD)
    env.reset(PROMPT)
    low = env.step("#### 300")
    assert (low.text, low.role, low.done, low.reward) == ("300 is too low. Try again.", "user", False, 0.0)
    assert env.step("#### 400").text == "400 is too high. Try again."
    assert "no answer" in env.step("I do not know").text
    right = env.step("#### 391")
    assert right.done and right.reward == 0.5 ** 3  # right at turn 4


def test_registry():
    assert environment_tools("python_tool")[0].name == "python" and environment_tools("feedback") == ()
    make = environment_factory("feedback", REWARD)
    assert isinstance(make(), FeedbackEnv) and make() is not make()
    for name, error in [("chess", "expected one of"), ("nowhere.module:Env", "cannot import"),
                        ("megatron_offgrpo.data:SamplingParams", "does not make an Environment")]:
        with pytest.raises(ValueError, match=error):
            environment_factory(name, REWARD)
    with pytest.raises(ValueError, match="with no arguments"):
        environment_factory("megatron_offgrpo.envs:FeedbackEnv", REWARD)  # needs its reward: not a factory
    custom = environment_factory("tests.envs.test_environments:EchoEnv", REWARD)
    assert custom is EchoEnv and environment_tools("tests.envs.test_environments:EchoEnv") == ()


class EchoEnv:
    """A user's environment, named by its dotted path."""

    tools = ()

    def reset(self, prompt: Prompt) -> None:
        pass

    def step(self, turn: str) -> Observation:
        return Observation(turn, done=True)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("code", [
    "while True: pass",
    "import os\nwhile True: os.fork()",
    "x = bytearray(10**10)",
    "print('x' * 10**6)",
    "print(open('/etc/passwd').read())",
    "import socket; socket.create_connection(('127.0.0.1', 22))",
])
def test_hostile_tool_code_is_a_tool_error_and_the_episode_goes_on(code):
    """Each hostile call comes back as a tool response with an error line; the next call of the same episode runs."""
    env = PythonToolEnv(REWARD, SandboxLimits(cpu_seconds=1, wall_seconds=3, output_bytes=512))
    env.reset(PROMPT)
    hostile = env.step(_call(json.dumps({"name": "python", "arguments": {"code": code}})))
    assert hostile.role == "tool" and hostile.tool_error and not hostile.done and "error:" in hostile.text
    assert len(hostile.text) < 1024  # the model reads a bounded answer
    after = env.step(_call('{"name": "python", "arguments": {"code": "print(6 * 7)"}}'))
    assert after.text.strip() == "42" and not after.tool_error
