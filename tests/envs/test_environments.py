"""The shipped environments and the registry: what the model reads back, the rewards, one-line errors."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest

from megatron_offgrpo.data import Prompt, rewards
from megatron_offgrpo.envs import (
    Environment,
    EnvironmentCall,
    EnvironmentContractError,
    EnvironmentTimeout,
    Observation,
    SandboxLimits,
    bounded_calls,
    checked_observation,
    environment_factory,
    environment_name_error,
    environment_tools,
)
from megatron_offgrpo.envs._feedback import FeedbackEnv
from megatron_offgrpo.envs._python_tool import PythonToolEnv, parse_tool_call

REWARD = rewards.get_reward("math_exact")
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
                        ("megatron_offgrpo.data:SamplingParams", "has no reset, step, close"),
                        ("os:sep", "is a str, not a class or function")]:
        with pytest.raises(ValueError, match=error):
            environment_factory(name, REWARD)
    with pytest.raises(EnvironmentContractError, match="made str, not an Environment"):
        environment_factory("os:getcwd", REWARD)  # a zero-argument function: what it makes is probed
    with pytest.raises(ValueError, match="with no arguments"):
        environment_factory("megatron_offgrpo.envs._feedback:FeedbackEnv", REWARD)  # needs its reward: not a factory
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


def _hang(release: threading.Event):
    release.wait()  # a user's call stuck on something that never comes (here: until the test releases it)


def test_a_stuck_call_is_abandoned_at_its_deadline_and_named():
    """Four calls on two threads, one stuck: the wait ends at the stuck call's deadline with its name and the key;
    the calls not yet started never start; the stuck thread is a daemon (it cannot keep the process alive)."""
    release, ran = threading.Event(), []
    calls = [EnvironmentCall("Fine.step", lambda: ran.append(0) or "a"),
             EnvironmentCall("Stuck.step", lambda: _hang(release)),
             EnvironmentCall("Slow.step", lambda: time.sleep(0.05) or ran.append(2)),
             EnvironmentCall("Later.step", lambda: ran.append(3))]
    start = time.monotonic()
    with pytest.raises(EnvironmentTimeout, match=r"environment Stuck\.step did not return within 0\.4 s "
                                                 r"\(env\.step_timeout_s\)"):
        bounded_calls(calls, timeout_s=0.4, threads=2)
    assert 0.4 <= time.monotonic() - start < 2.0
    stuck = [t for t in threading.enumerate() if t.name.startswith("offgrpo-env") and t.is_alive()]
    assert stuck and all(t.daemon for t in stuck)
    with pytest.raises(EnvironmentTimeout, match="Stuck.step"):  # one thread: the call behind it never starts
        bounded_calls([calls[1], EnvironmentCall("Behind.step", lambda: ran.append("behind"))], 0.2, threads=1)
    release.set()
    assert bounded_calls(calls[:1] + calls[2:], timeout_s=5, threads=3) == ["a", None, None]  # slow is not stuck
    time.sleep(0.05)
    assert "behind" not in ran


def test_the_users_own_exception_keeps_its_traceback():
    def step():
        raise KeyError("the environment's own bug")

    with pytest.raises(KeyError) as info:
        bounded_calls([EnvironmentCall("Buggy.step", lambda: 1), EnvironmentCall("Buggy.step", step)], 5, threads=2)
    assert "in step" in "".join(traceback.format_tb(info.value.__traceback__))  # the user's frame is there


def test_a_signal_is_handled_while_a_call_is_stuck():
    """SIGTERM only sets a flag (train._stop): the bounded wait must let the handler run at once, not after it."""
    heard, release = [], threading.Event()
    previous = signal.signal(signal.SIGALRM, lambda *_: heard.append(time.monotonic()))
    try:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(EnvironmentTimeout):
            bounded_calls([EnvironmentCall("Stuck.step", lambda: _hang(release))], timeout_s=0.6)
    finally:
        signal.signal(signal.SIGALRM, previous)
        release.set()
    assert heard and heard[0] - start < 0.5


def test_a_process_with_a_stuck_environment_still_exits():
    """The run ends with the named line and the process exits although the stuck call never returns."""
    code = ("import threading\nfrom megatron_offgrpo.envs import EnvironmentCall, bounded_calls\n"
            "bounded_calls([EnvironmentCall('Stuck.step', threading.Event().wait)], timeout_s=0.3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "EnvironmentTimeout: environment Stuck.step did not return" in proc.stderr


@pytest.mark.parametrize(("returned", "named"), [
    ({"text": "hi", "reward": 1.0}, r"returned \{'text': 'hi', 'reward': 1\.0\} \(dict\): expected a "
                                    r"megatron_offgrpo\.envs\.Observation"),
    ("too low", r"returned 'too low' \(str\)"),
    (None, r"returned None \(NoneType\)"),
    (Observation("x", reward="1"), r"reward='1' \(str\): expected a finite number"),
    (Observation("x", reward=math.nan), r"reward=nan \(float\)"),
    (Observation("x", reward=-math.inf), r"reward=-inf \(float\)"),
    (Observation("x", reward=True), r"reward=True \(bool\)"),
    (Observation(None), r"text=None \(NoneType\): expected a str"),
    (Observation("x", done="yes"), r"done='yes' \(str\): expected True or False"),
])
def test_a_broken_contract_is_one_line_naming_class_method_and_value(returned, named):
    with pytest.raises(EnvironmentContractError, match=r"^environment MyEnv\.step (returned an Observation with )?"
                                                       + named):
        checked_observation("MyEnv.step", returned)
    assert checked_observation("MyEnv.step", Observation("ok", reward=2)) == Observation("ok", reward=2.0)
    numpy_typed = checked_observation("MyEnv.step", Observation("ok", reward=np.float32(0.5), done=np.bool_(True)))
    assert numpy_typed == Observation("ok", reward=0.5, done=True) and type(numpy_typed.reward) is float


@pytest.mark.parametrize(("name", "error"), [
    ("nosuch", "expected one of ['feedback', 'python_tool'] or 'package.module:Factory'"),
    ("os:system", "env.name='os:system' cannot be called with no arguments (it takes command)"),
    ("tests.envs.test_environments:needs_a_seed", "cannot be called with no arguments (it takes seed)"),
    ("tests.envs.test_environments:NoStep", "the class NoStep has no step"),
    ("tests.envs.test_environments:nowhere", "cannot import 'nowhere'"),
    ("tests.envs.test_environments:EchoEnv", None),
    ("tests.envs.test_environments:echo_factory", None),
])
def test_the_name_is_checked_without_running_the_users_code(name, error):
    assert environment_name_error(name) == error or error in environment_name_error(name)


def needs_a_seed(seed):
    return EchoEnv()


def echo_factory(seed: int = 0):
    return EchoEnv()


class NoStep:
    tools = ()

    def reset(self, prompt):
        pass

    def close(self):
        pass
