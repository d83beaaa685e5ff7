"""The OpenEnv adapter (``envs.OpenEnvEnvironment``, the ``openenv`` extra) on OpenEnv's own environment: the echo
environment that ``openenv init`` writes (the package's scaffold, the one environment it ships), stepped in-process and
served by OpenEnv's own server on the loopback, through its generated WebSocket client. Nothing of OpenEnv is mocked.

The echo environment never ends an episode (the scaffold leaves the end to the author), so the episodes that must end
run ``Farewell``: the generated environment with the one rule an author adds, a turn of "bye" is the last.
Without OpenEnv installed these tests are skipped, except the one-line error that names the extra.
"""

from __future__ import annotations

import gc
import socket
import sys
import threading
import time
import weakref

import pytest

from megatron_offgrpo import MissingExtra
from megatron_offgrpo.data import Prompt
from megatron_offgrpo.envs import Environment, Observation, OpenEnvEnvironment

NOT_INSTALLED = "OpenEnv is not installed: pip install 'megatron-offgrpo[openenv]'"
PROMPT = Prompt("echo/0", (1, 2, 3), text="say something")
ECHO = "word_echo.server.word_echo_environment:WordEchoEnvironment"
# special tokens are removed before step, but the rest of a turn (spaces, newlines, markup, non-ASCII) must arrive as
# is. 10 characters: the echo environment rewards 0.1 a character, which openenv's 0.10 template caps at 1.0
ODD_TURN = ' {"ü"}\n\t✓ '


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """The package ``word_echo`` as ``openenv init word_echo`` writes it, on sys.path; yields its modules and
    ``Farewell``."""
    pytest.importorskip("openenv.core.env_server", reason=NOT_INSTALLED)
    from openenv.cli.commands.init import init

    root = tmp_path_factory.mktemp("openenv")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", "")  # init runs `uv lock` (the network) when uv is on PATH; without it, a warning only
        init("word_echo", output_dir=str(root))
    sys.path.insert(0, str(root))
    from word_echo import models
    from word_echo.server import word_echo_environment

    class Farewell(word_echo_environment.WordEchoEnvironment):
        """The generated echo environment, ended by a turn of "bye", its episode named at reset as openenv 0.10's
        template does; records the episodes it closed."""

        closed: list[str] = []

        def reset(self, seed=None, episode_id=None, **kwargs):
            observation = super().reset()  # openenv-core 0.3's template takes no arguments
            self.state.episode_id = episode_id or self.state.episode_id
            return observation

        def step(self, action):
            observation = super().step(action)
            observation.done = action.message == "bye"
            return observation

        def close(self) -> None:
            Farewell.closed.append(self.state.episode_id)
            super().close()

    yield models, word_echo_environment, Farewell
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "word_echo" or m.startswith("word_echo.")]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def served(echo):
    """``Farewell`` behind OpenEnv's server (``create_app``, as the generated ``server/app.py`` builds it: one session
    at a time) on a free loopback port, in a thread; yields its URL."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    models, _, farewell = echo
    app = create_app(farewell, models.WordEchoAction, models.WordEchoObservation, env_name="word_echo",
                     max_concurrent_envs=1)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "OpenEnv's server did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_an_episode_in_process_passes_each_turn_unchanged_and_its_reward_back(echo):
    env = OpenEnvEnvironment(ECHO)  # by its path, as a config names it; action and fields inferred
    assert isinstance(env, Environment) and env.tools == ()
    assert (env.action.__name__, env.action_field) == ("WordEchoAction", "message")
    env.reset(PROMPT)
    assert env.opening == "Word Echo environment ready!"
    # the echo environment answers the turn itself, rewarded 0.1 per character: "hello" -> 0.5, ODD_TURN -> 1.0
    turns = ["hello", ODD_TURN, ""]
    answers = [env.step(turn) for turn in turns]
    assert [a.text for a in answers] == turns
    assert [a.reward for a in answers] == pytest.approx([0.5, 1.0, 0.0])
    assert {(a.role, a.done, a.tool_error) for a in answers} == {("user", False, False)}
    assert env.env.state.step_count == 3
    env.close()


def test_done_ends_the_episode_and_close_releases_the_environment(echo):
    _, _, farewell = echo
    # a class (any factory) instead of a path; the prompt's id names the episode
    env = OpenEnvEnvironment(farewell, role="tool", prompt_fields={"episode_id": "prompt_id"})
    env.reset(PROMPT)
    held = weakref.ref(env.env)
    assert env.env.state.episode_id == "echo/0"
    assert env.step("one") == Observation("one", role="tool", reward=pytest.approx(0.3))
    assert env.step("bye") == Observation("bye", role="tool", reward=pytest.approx(0.3), done=True)
    with pytest.raises(RuntimeError, match="done"):
        env.step("more")
    env.close()
    env.close()  # once more: nothing left to close
    gc.collect()
    assert farewell.closed[-1] == "echo/0" and held() is None


def test_an_episode_over_the_wire_and_close_frees_the_servers_one_slot(echo, served):
    _, _, farewell = echo
    kwargs = {"env": "word_echo.client:WordEchoEnv", "env_kwargs": {"base_url": served}}
    first = OpenEnvEnvironment(**kwargs)  # the generated async client, driven through its .sync()
    first.reset(PROMPT)
    assert first.step(ODD_TURN) == Observation(ODD_TURN, reward=pytest.approx(1.0))
    from websockets.exceptions import ConnectionClosed

    second = OpenEnvEnvironment(**kwargs)
    # the one session is the first episode's: the server answers CAPACITY_REACHED and hangs up at once, so the client
    # reads either that answer or the closed socket, whichever comes first
    with pytest.raises((RuntimeError, ConnectionClosed), match="CAPACITY_REACHED|1000"):
        second.reset(PROMPT)
    second.close()
    assert first.step("bye").done
    closed = len(farewell.closed)
    first.close()
    deadline = time.monotonic() + 10
    while len(farewell.closed) == closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(farewell.closed) == closed + 1, "the server kept the closed episode's environment"
    third = OpenEnvEnvironment(**kwargs)  # the slot is free again
    third.reset(PROMPT)
    assert third.step("hi") == Observation("hi", reward=pytest.approx(0.2))
    third.close()


def test_fields_that_cannot_be_mapped_are_named(echo):
    with pytest.raises(ValueError, match=r"text_field='reply': WordEchoObservation has the fields \['done'"):
        OpenEnvEnvironment(ECHO, text_field="reply").reset(PROMPT)
    with pytest.raises(ValueError, match=r"action_field='text': WordEchoAction has the fields \['metadata', "):
        OpenEnvEnvironment(ECHO, action_field="text")
    with pytest.raises(ValueError, match=r"env='word_echo.server.word_echo_environment:Nope': cannot import"):
        OpenEnvEnvironment(ECHO.replace("WordEchoEnvironment", "Nope"))
    with pytest.raises(ValueError, match=r"prompt_fields=\{'seed': 'question'\}: not fields of a Prompt"):
        OpenEnvEnvironment(ECHO, prompt_fields={"seed": "question"})


def test_without_openenv_one_line_names_the_extra(monkeypatch):
    """Runs with or without OpenEnv installed: an import hook hides it, as if it were not."""

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name == "openenv" or name.startswith("openenv."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    for name in [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")]:
        monkeypatch.delitem(sys.modules, name)  # put back after the test
    monkeypatch.setattr(sys, "meta_path", [Absent(), *sys.meta_path])
    with pytest.raises(MissingExtra) as err:
        OpenEnvEnvironment("word_echo.server.word_echo_environment:WordEchoEnvironment")
    message = str(err.value)
    assert "\n" not in message and "pip install 'megatron-offgrpo[openenv]'" in message, message
    assert message.startswith("envs.OpenEnvEnvironment needs openenv, which is not installed"), message
