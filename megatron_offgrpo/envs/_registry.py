"""Environments by name: the shipped ones, or ``package.module:Factory`` for your own."""

from __future__ import annotations

import inspect
from typing import Callable

from megatron_offgrpo.data import rewards
from megatron_offgrpo.envs._feedback import FeedbackEnv
from megatron_offgrpo.envs._guard import EnvironmentCall, EnvironmentContractError, bounded_calls
from megatron_offgrpo.envs._protocol import Environment, ToolSpec
from megatron_offgrpo.envs._python_tool import PythonToolEnv
from megatron_offgrpo.envs._sandbox import SandboxLimits

SHIPPED = ("feedback", "python_tool")


def environment_factory(name: str, reward_fn: Callable[[str, str | None], float],
                        limits: SandboxLimits | None = None, timeout_s: float = 300.0) -> Callable[[], Environment]:
    """A callable that makes a fresh environment per episode.

    Args:
        name: "python_tool" (a sandboxed Python tool, rewarded by ``reward_fn`` on the final answer), "feedback"
            (too low / too high, then try again), or "package.module:Factory": any zero-argument callable (a class)
            returning an ``Environment``, importable on the rank that generates.
        reward_fn: the task's reward (``data.reward``), for the shipped environments.
        limits: the sandbox's limits for each tool run (``python_tool``; None: ``SandboxLimits()``).
        timeout_s: how long the probe's calls (the factory, ``close``) may take (``env.step_timeout_s``).

    Raises:
        ValueError: an unknown name, a path that does not import (``environment_name_error``).
        EnvironmentContractError: the factory's product is not an ``Environment`` (checked on one instance, made and
            closed here: before any engine starts). EnvironmentTimeout: the probe's factory or close did not return
            within ``timeout_s``. The factory's own exceptions as they are (their traceback is the user's).
    """
    if name == "python_tool":
        return lambda: PythonToolEnv(reward_fn, limits)
    if name == "feedback":
        return lambda: FeedbackEnv(reward_fn)
    error = environment_name_error(name)
    if error is not None:
        raise ValueError(error)
    factory = _imported(name)
    # no arguments is checked on the signature (``environment_name_error``): an exception here is the factory's own,
    # and keeps its traceback
    probe = bounded_calls([EnvironmentCall(f"factory {name}", factory)], timeout_s)[0]
    if not isinstance(probe, Environment):
        raise EnvironmentContractError(f"env.name={name!r} made {type(probe).__name__}, not an Environment "
                                       "(reset(prompt), step(turn) -> Observation, close() and a tools tuple): see "
                                       "megatron_offgrpo.envs.Environment")
    bounded_calls([EnvironmentCall(f"{type(probe).__name__}.close", probe.close)], timeout_s)
    return factory


def environment_name_error(name: str) -> str | None:
    """What is wrong with ``env.name`` as far as it can be told without running the user's code (the one check of
    the config's validation: ``offgrpo config``, ``train`` and ``eval`` refuse alike), or None: a shipped name, or
    ``package.module:Name`` that imports and names a class with ``reset``, ``step`` and ``close``, or a function
    callable with no arguments (what it makes is checked when the factory is probed, ``environment_factory``)."""
    if name in SHIPPED:
        return None
    if ":" not in name:
        return f"env.name={name!r}: expected one of {list(SHIPPED)} or 'package.module:Factory'"
    try:
        factory = _imported(name)
    except ValueError as exc:
        return str(exc)
    if not callable(factory):
        return f"env.name={name!r} is a {type(factory).__name__}, not a class or function that makes an environment"
    missing = [m for m in ("reset", "step", "close") if not callable(getattr(factory, m, None))]
    if isinstance(factory, type) and missing:
        return (f"env.name={name!r}: the class {factory.__name__} has no {', '.join(missing)}: an environment needs "
                "reset(prompt), step(turn) -> Observation and close() (megatron_offgrpo.envs.Environment)")
    if required := _required_parameters(factory):
        return (f"env.name={name!r} cannot be called with no arguments (it takes {', '.join(required)}): name a "
                "class or function that makes an environment from nothing")
    return None


def _required_parameters(fn) -> list[str]:
    """The parameters ``fn()`` would miss ([] when its signature cannot be read: the probe's call then tells)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values() if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _imported(name: str):
    return rewards.import_dotted(name, "env.name")


def environment_tools(name: str) -> tuple[ToolSpec, ...]:
    """The tools the environment ``name`` announces in the prompt (its class's ``tools``; a factory without the
    attribute announces none)."""
    if name == "python_tool":
        return PythonToolEnv.tools
    if name == "feedback":
        return FeedbackEnv.tools
    error = environment_name_error(name)
    if error is not None:
        raise ValueError(error)
    return tuple(getattr(_imported(name), "tools", ()))
