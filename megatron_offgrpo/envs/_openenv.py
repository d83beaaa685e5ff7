"""An OpenEnv environment (``openenv-core``, the ``openenv`` extra) as one of ours: text turns in, observations out.

OpenEnv environments are Gym-style: ``reset() -> Observation`` and ``step(Action) -> Observation``, where actions and
observations are pydantic models, each environment declaring its own fields next to the base ones (an observation's
``done``, ``reward`` and ``metadata``). A client of a served environment (an ``EnvClient`` subclass, one WebSocket
session per instance) answers a ``StepResult(observation, reward, done)`` instead; both kinds are accepted, and an
async client is driven through its own ``.sync()`` wrapper.

The mapping, per call of our protocol:

- ``reset(prompt)`` -> ``env.reset(**reset_kwargs, **{kwarg: prompt.<field>})`` (``prompt_fields`` says which of the
  prompt's fields, if any, the environment's reset takes). Its observation's text is kept in ``opening``.
- ``step(turn)`` -> ``env.step(Action(<action_field>=turn))``, the turn's text unchanged -> ``Observation(text=the
  observation's <text_field>, role, reward (None -> 0.0), done, tool_error=whether it has an ``error`` set)``.
- ``close()`` -> ``env.close()`` (a client also ends its server session, which frees the server's slot).

Not mapped: OpenEnv's MCP tool environments (``ListToolsAction`` / ``CallToolAction``) are not translated to our
``tools`` and ``<tool_call>`` turns, so ``tools`` is empty; the opening observation, which in OpenEnv often carries
the task, does not reach the prompt (the prompt is the dataset's: ``opening`` keeps it for whoever needs it);
actions that are not one text field (token ids, structured moves) need an environment-side action with a text field.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from megatron_offgrpo import require_extra
from megatron_offgrpo.data import Prompt
from megatron_offgrpo.envs._protocol import ROLES, Observation, ToolSpec

EXTRA = "openenv"
BASE_OBSERVATION_FIELDS = ("done", "reward", "metadata")  # every OpenEnv observation's: never the text


def _openenv() -> tuple[type, type]:
    """OpenEnv's ``Action`` base and async ``EnvClient`` base, imported on first use (the extra is optional)."""
    types = require_extra("openenv.core.env_server.types", EXTRA, "envs.OpenEnvEnvironment")
    client = require_extra("openenv.core.env_client", EXTRA, "envs.OpenEnvEnvironment")
    return types.Action, client.EnvClient


def _resolve(path: str | Any, key: str) -> Any:
    """``"package.module:Name"`` (or ``"package.module.Name"``) -> the object; anything else is returned as it is.

    Raises:
        ValueError: naming ``key`` and the path when the module or the name cannot be imported.
    """
    if not isinstance(path, str):
        return path
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{key}={path!r}: cannot import {name!r} from {module!r} ({exc}); "
                         "expected 'package.module:Name'") from exc


def _action_class(env: Any, action_base: type) -> type | None:
    """The action model ``env`` steps with: a generic argument of its class (``EnvClient[MyAction, ...]``,
    ``Environment[MyAction, ...]``), else the annotation of the ``action`` of a ``step`` in its classes (an override
    without one defers to its parent's); None when nothing says."""

    def action(arg: Any) -> bool:
        return inspect.isclass(arg) and issubclass(arg, action_base) and arg is not action_base

    env = getattr(env, "async_client", env)  # a client already wrapped by ``.sync()``: its generics are TypeVars
    mro = type(env).__mro__
    found = [arg for klass in mro for base in getattr(klass, "__orig_bases__", ()) for arg in typing.get_args(base)]
    for klass in mro:
        if "step" in vars(klass):
            try:
                found.append(typing.get_type_hints(vars(klass)["step"]).get("action"))
            except Exception:  # an annotation that does not resolve only means: not inferable here
                continue
    return next((arg for arg in found if action(arg)), None)


def _text_fields(model: type, exclude: tuple[str, ...], required: bool) -> list[str]:
    """The ``str`` fields of a pydantic model class, less ``exclude`` (and, with ``required``, the optional ones)."""
    return [name for name, info in model.model_fields.items()
            if name not in exclude and info.annotation is str and (info.is_required() or not required)]


class OpenEnvEnvironment:
    """One episode of an OpenEnv environment, behind our ``Environment`` protocol.

    Build it once per episode (the runner's factory), e.g. ``functools.partial(OpenEnvEnvironment,
    "my_env.server.my_environment:MyEnvironment")``, or for a served one ``OpenEnvEnvironment("my_env.client:MyEnv",
    env_kwargs={"base_url": "http://127.0.0.1:8000"})``.

    Args:
        env: the environment (or client) class or factory, or its ``"package.module:Name"`` path.
        env_kwargs: keyword arguments for ``env``.
        action: the action model class (or its path); default: inferred from the environment's generic arguments or
            its ``step`` annotation.
        action_field: the action's field that receives the turn's text; default: its only required ``str`` field.
        text_field: the observation's field shown to the model; default: its only ``str`` field beyond the base ones.
        role: how the chat template wraps every observation, "user" or "tool" (OpenEnv has no roles).
        reset_kwargs: fixed keyword arguments of every ``reset`` (``seed``, an environment's own options).
        prompt_fields: ``{reset keyword: Prompt field}`` passed per episode (e.g. ``{"episode_id": "prompt_id"}``).

    Raises:
        MissingExtra: (an ``ImportError``) when OpenEnv is not installed, naming the extra to install.
        ValueError: a path that does not import, an unknown role or prompt field, an action whose text field is
            ambiguous or missing.
    """

    tools: tuple[ToolSpec, ...] = ()

    def __init__(self, env: str | Callable[..., Any], *, env_kwargs: Mapping[str, Any] | None = None,
                 action: str | type | None = None, action_field: str | None = None, text_field: str | None = None,
                 role: str = "user", reset_kwargs: Mapping[str, Any] | None = None,
                 prompt_fields: Mapping[str, str] | None = None) -> None:
        action_base, async_client = _openenv()
        if role not in ROLES:
            raise ValueError(f"role={role!r}: expected one of {list(ROLES)}")
        known = [f.name for f in dataclasses.fields(Prompt)]
        bad = {k: v for k, v in (prompt_fields or {}).items() if v not in known}
        if bad:
            raise ValueError(f"prompt_fields={bad}: not fields of a Prompt; valid: {known}")
        self.role, self.text_field = role, text_field
        self.reset_kwargs, self.prompt_fields = dict(reset_kwargs or {}), dict(prompt_fields or {})
        factory = _resolve(env, "env")
        if not callable(factory):
            raise ValueError(f"env={env!r} is not a class or a callable")
        self.env = factory(**dict(env_kwargs or {}))
        # An async client answers coroutines; its own sync wrapper runs them on a private event loop thread, so
        # ``step`` stays a plain call from whichever worker thread runs the episode.
        self.action = _resolve(action, "action") or _action_class(self.env, action_base)
        if isinstance(self.env, async_client):
            self.env = self.env.sync()
        if not (inspect.isclass(self.action) and issubclass(self.action, action_base)):
            raise ValueError(f"action={action!r}: no OpenEnv Action class given or inferable from "
                             f"{type(self.env).__name__}; pass action='package.module:MyAction'")
        self.action_field = action_field or self._only_field(self.action, "action_field", ("metadata",), True)
        if self.action_field not in self.action.model_fields:
            raise ValueError(f"action_field={self.action_field!r}: {self.action.__name__} has the fields "
                             f"{list(self.action.model_fields)}")
        self.opening: str = ""
        self._done = False
        self._started = False

    @staticmethod
    def _only_field(model: type, key: str, exclude: tuple[str, ...], required: bool) -> str:
        candidates = _text_fields(model, exclude, required)
        if len(candidates) != 1:
            raise ValueError(f"{model.__name__} has {len(candidates)} candidate text fields {candidates} among "
                             f"{list(model.model_fields)}: set {key}=")
        return candidates[0]

    def _answer(self, result: Any) -> Observation:
        """An observation, or a client's ``StepResult`` wrapping one, as our ``Observation``."""
        obs = getattr(result, "observation", result)
        field = self.text_field or self._only_field(type(obs), "text_field", BASE_OBSERVATION_FIELDS, False)
        if field not in type(obs).model_fields:
            raise ValueError(f"text_field={field!r}: {type(obs).__name__} has the fields "
                             f"{list(type(obs).model_fields)}")
        reward = getattr(result, "reward", None)
        done = bool(getattr(result, "done", False))
        return Observation(text=str(getattr(obs, field)), role=self.role,
                           reward=0.0 if reward is None else float(reward), done=done,
                           tool_error=getattr(obs, "error", None) is not None)

    def reset(self, prompt: Prompt) -> None:
        """Start the environment's episode; its opening observation's text goes to ``opening``."""
        if self.env is None:
            raise RuntimeError("reset after close: build a new OpenEnvEnvironment per episode")
        kwargs = {**self.reset_kwargs, **{k: getattr(prompt, v) for k, v in self.prompt_fields.items()}}
        opening = self._answer(self.env.reset(**kwargs))
        self.opening, self._done, self._started = opening.text, opening.done, True

    def step(self, turn: str) -> Observation:
        """The turn's text, as the action's ``action_field``, to the environment; its observation back."""
        if self.env is None or not self._started or self._done:
            state = "closed" if self.env is None else "done" if self._done else "not reset"
            raise RuntimeError(f"step on an episode that is {state}")
        answer = self._answer(self.env.step(self.action(**{self.action_field: turn})))
        self._done = answer.done
        return answer

    def close(self) -> None:
        """Close the environment (a client: its server session) and drop it; a second call does nothing."""
        env, self.env = self.env, None
        if env is not None:
            env.close()
