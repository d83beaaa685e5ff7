"""Rollout: the trainer-side client of generation, the engines that produce samples with versioned weights.

``RolloutEngine`` is what the trainer calls; ``make_engine`` builds one from its typed spec (``specs``): the vLLM
fleet client (``FleetEngine`` over the servers ``fleet`` started, refreshed through a ``transports.WeightTransport``),
an in-process ``VLLMEngine``, or a ``TransformersEngine`` for machines without vLLM. ``verify_refresh`` checks a
refresh against the trainer's probe log-probs. ``TeacherFleet`` scores samples on a distillation teacher's own fleet.
Nothing here imports megatron: the rollout side runs where megatron is not installed.
"""

from megatron_offgrpo.rollout import _specs as specs  # specs.VllmSpec(...): the engine kinds' settings, one name
from megatron_offgrpo.rollout._dispatch import RetryPolicy
from megatron_offgrpo.rollout._episodes import EpisodeLimits, EpisodeRunner, EpisodeStats
from megatron_offgrpo.rollout._errors import (
    EngineDiedError,
    FleetError,
    RefreshError,
    RefreshVerificationError,
    UnservableModelError,
)
from megatron_offgrpo.rollout._factory import have_vllm, make_engine
from megatron_offgrpo.rollout._fleet import FleetEngine
from megatron_offgrpo.rollout._hf_engine import TransformersEngine
from megatron_offgrpo.rollout._protocol import RolloutEngine
from megatron_offgrpo.rollout._server import ServerClient, servers_of
from megatron_offgrpo.rollout._teacher_fleet import TeacherFleet
from megatron_offgrpo.rollout._types import PROBE_ATOL, RefreshReport, probe_atol, probe_bound
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh

__all__ = [
    "EngineDiedError",
    "EpisodeLimits",
    "EpisodeRunner",
    "EpisodeStats",
    "PROBE_ATOL",
    "FleetEngine",
    "FleetError",
    "RefreshError",
    "RefreshReport",
    "RefreshVerificationError",
    "RetryPolicy",
    "RolloutEngine",
    "ServerClient",
    "TeacherFleet",
    "TransformersEngine",
    "UnservableModelError",
    "have_vllm",
    "make_engine",
    "make_probe_ids",
    "probe_atol",
    "probe_bound",
    "servers_of",
    "specs",
    "verify_refresh",
]


def __getattr__(name: str):
    # The in-process vLLM engine imports vllm (seconds, and absent on some machines): load it only when used.
    if name == "VLLMEngine":
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
