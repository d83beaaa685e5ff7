"""Environments for multi-turn episodes: the protocol, the shipped environments, adapters to ecosystem ones."""

from megatron_offgrpo.envs._protocol import ROLES, Environment, Observation, ToolSpec
from megatron_offgrpo.envs._sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "ROLES",
    "Environment",
    "Observation",
    "SandboxLimits",
    "SandboxResult",
    "ToolSpec",
    "run_python",
]
