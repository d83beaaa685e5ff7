"""Environments for multi-turn episodes: the protocol, the shipped environments, adapters to ecosystem ones."""

from megatron_offgrpo.envs._openenv import OpenEnvEnvironment
from megatron_offgrpo.envs._protocol import ROLES, Environment, Observation, ToolSpec

__all__ = [
    "ROLES",
    "Environment",
    "Observation",
    "OpenEnvEnvironment",
    "ToolSpec",
]
