"""Environments for multi-turn episodes: the protocol, the shipped environments, adapters to ecosystem ones.

``Environment`` is what an episode talks to (reset with a prompt, step with the model's turn, an ``Observation``
back); ``environment_factory`` builds one per episode from ``env.name``: "python_tool" (``PythonToolEnv``, a
sandboxed Python tool: ``run_python``), "feedback" (``FeedbackEnv``), or your own ``package.module:Factory``;
``OpenEnvEnvironment`` runs an OpenEnv environment as one (the ``openenv`` extra). ``bounded_calls`` runs a user's
environment code with a deadline (``EnvironmentTimeout``), ``checked_observation`` holds it to the protocol
(``EnvironmentContractError``).
"""

from megatron_offgrpo.envs._guard import (EnvironmentCall, EnvironmentContractError, EnvironmentTimeout,
                                          bounded_calls, checked_observation)
from megatron_offgrpo.envs._openenv import OpenEnvEnvironment
from megatron_offgrpo.envs._protocol import ROLES, Environment, Observation, ToolSpec
from megatron_offgrpo.envs._registry import SHIPPED, environment_factory, environment_name_error, environment_tools
from megatron_offgrpo.envs._sandbox import SandboxLimits

__all__ = [
    "ROLES",
    "SHIPPED",
    "Environment",
    "EnvironmentCall",
    "EnvironmentContractError",
    "EnvironmentTimeout",
    "Observation",
    "OpenEnvEnvironment",
    "SandboxLimits",
    "ToolSpec",
    "bounded_calls",
    "checked_observation",
    "environment_factory",
    "environment_name_error",
    "environment_tools",
]
