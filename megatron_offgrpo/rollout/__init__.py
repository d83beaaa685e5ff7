"""Rollout: the trainer-side client of generation, the engines that produce samples with versioned weights.

``RolloutEngine`` is what the trainer calls; ``make_engine`` builds one from its typed spec (``specs``): the vLLM
fleet client (``FleetEngine`` over the servers ``fleet`` started, refreshed through a ``transports.WeightTransport``),
an in-process ``VLLMEngine``, or a ``TransformersEngine`` for machines without vLLM. ``probes.verify_refresh``
checks a refresh against the trainer's probe log-probs (``probes``: the probe, the check, its tolerances).
``multiturn`` runs multi-turn episodes over any engine (``multiturn.EpisodeRunner``); ``errors`` holds the room's
errors (``errors.RefreshError`` ...). ``ScoringPool`` spreads scoring requests over a fleet of their own (a failing
server's going to the others): ``TeacherFleet`` scores samples on a distillation teacher's, a reward model's fleet
answers ``ServerClient.classify``.
Nothing here imports megatron: the rollout side runs where megatron is not installed.
"""

from megatron_offgrpo.rollout import _episodes as multiturn  # multiturn.EpisodeRunner(...): episodes, one name
from megatron_offgrpo.rollout import _errors as errors  # errors.RefreshError: the room's errors, one name
from megatron_offgrpo.rollout import _probes as probes  # probes.verify_refresh(...): the refresh check, one name
from megatron_offgrpo.rollout import _specs as specs  # specs.VllmSpec(...): the engine kinds' settings, one name
from megatron_offgrpo.rollout._dispatch import RetryPolicy
from megatron_offgrpo.rollout._factory import have_vllm, make_engine
from megatron_offgrpo.rollout._fleet import FleetEngine
from megatron_offgrpo.rollout._hf_engine import TransformersEngine
from megatron_offgrpo.rollout._protocol import RolloutEngine
from megatron_offgrpo.rollout._scoring import ScoringPool
from megatron_offgrpo.rollout._server import ServerClient, servers_of
from megatron_offgrpo.rollout._teacher_fleet import TeacherFleet
from megatron_offgrpo.rollout._types import RefreshReport

__all__ = [
    "FleetEngine",
    "RefreshReport",
    "RetryPolicy",
    "RolloutEngine",
    "ScoringPool",
    "ServerClient",
    "TeacherFleet",
    "TransformersEngine",
    "errors",
    "have_vllm",
    "make_engine",
    "multiturn",
    "probes",
    "servers_of",
    "specs",
]

def __getattr__(name: str):
    # The in-process vLLM engine imports vllm (seconds, and absent on some machines): load it only when used.
    if name == "VLLMEngine":
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
