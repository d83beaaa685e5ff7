"""Environments by name: the shipped ones, or ``package.module:Factory`` for your own."""

from __future__ import annotations

from typing import Callable

from megatron_offgrpo.data import import_dotted
from megatron_offgrpo.envs._feedback import FeedbackEnv
from megatron_offgrpo.envs._protocol import Environment, ToolSpec
from megatron_offgrpo.envs._python_tool import PythonToolEnv
from megatron_offgrpo.envs._sandbox import SandboxLimits

SHIPPED = ("feedback", "python_tool")


def environment_factory(name: str, reward_fn: Callable[[str, str | None], float],
                        limits: SandboxLimits | None = None) -> Callable[[], Environment]:
    """A callable that makes a fresh environment per episode.

    Args:
        name: "python_tool" (a sandboxed Python tool, rewarded by ``reward_fn`` on the final answer), "feedback"
            (too low / too high, then try again), or "package.module:Factory": any zero-argument callable (a class)
            returning an ``Environment``, importable on the rank that generates.
        reward_fn: the task's reward (``data.reward``), for the shipped environments.
        limits: the sandbox's limits for each tool run (``python_tool``; None: ``SandboxLimits()``).

    Raises:
        ValueError: an unknown name, a path that does not import, or a factory whose product is not an
            ``Environment`` (checked on one instance, made and closed here: before any engine starts).
    """
    if name == "python_tool":
        return lambda: PythonToolEnv(reward_fn, limits)
    if name == "feedback":
        return lambda: FeedbackEnv(reward_fn)
    factory = _imported(name)
    try:
        probe = factory() if callable(factory) else None
    except TypeError as exc:
        raise ValueError(f"env.name={name!r}: calling it with no arguments failed ({exc}): name a class or "
                         "function that makes an environment from nothing") from None
    if not isinstance(probe, Environment):
        raise ValueError(f"env.name={name!r} does not make an Environment (reset(prompt), step(turn) -> Observation, "
                         "close() and a tools tuple): see megatron_offgrpo.envs.Environment")
    probe.close()
    return factory


def _imported(name: str):
    if ":" not in name:
        raise ValueError(f"env.name={name!r}: expected one of {list(SHIPPED)} or 'package.module:Factory'")
    return import_dotted(name, "env.name")


def environment_tools(name: str) -> tuple[ToolSpec, ...]:
    """The tools the environment ``name`` announces in the prompt (its class's ``tools``; a factory without the
    attribute announces none)."""
    if name == "python_tool":
        return PythonToolEnv.tools
    if name == "feedback":
        return FeedbackEnv.tools
    return tuple(getattr(_imported(name), "tools", ()))
