"""``TeacherFleet``: on-policy distillation's teacher served by a fleet of its own, scoring the sampled tokens.

A teacher larger than the student, or sharded differently, runs where vLLM runs it best: ``offgrpo fleet start
--model TEACHER`` on GPUs of its own, at its own tensor parallelism. Each sample's prompt and response go to one of
its servers as a prompt to score (``prompt_logprobs``, one greedy token after it, as the refresh probe asks): the
teacher's log-prob of every response token given everything before it, the episode's observations included. The
requests of a step go out at once, spread over the servers; a server that fails a request leaves it to the next one.
The trainer needs no copy of the teacher, and in ``rollout.mode=async`` the scoring runs beside the training.

These are the teacher's log-probs at temperature 1 (vLLM scores prompts from the raw logits): distillation through a
fleet needs ``rollout.temperature=1``, where the student's behavior log-probs are at temperature 1 too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_offgrpo.data import Sample
from megatron_offgrpo.rollout._samples import prompt_logprob_values
from megatron_offgrpo.rollout._scoring import ScoringPool
from megatron_offgrpo.rollout._server import ServerClient

WHAT = "distill.teacher_fleet"


class TeacherFleet:
    """The servers of a teacher's fleet, and the scoring of a step's samples on them (through a ``ScoringPool``:
    spread over the servers, a failing server's requests going to the others)."""

    def __init__(self, servers: list[ServerClient] | ScoringPool, requests_at_once: int = 32) -> None:
        """Raises ``FleetError`` when no server answers ``/health``."""
        self.pool = servers if isinstance(servers, ScoringPool) else ScoringPool(servers, WHAT, requests_at_once)
        self.servers = self.pool.servers

    @classmethod
    def from_state(cls, state: str | Path) -> TeacherFleet:
        """Connect to the teacher's fleet that ``offgrpo fleet start`` recorded (its state directory or file).

        Raises:
            ValueError: the fleet serves a sequence classifier (vLLM's pooling runner), not a causal LM.
        """
        return cls(ScoringPool.from_state(state, WHAT, "generate"))

    def score(self, samples: Sequence[Sample]) -> None:
        """Set each sample's ``teacher_logprobs``: the teacher's log-prob of each response token.

        Raises:
            FleetError: a sample that no server could score.
        """
        scores = self.pool.map(_response_logprobs, samples, [f"{s.prompt_id}/{s.group_id}" for s in samples])
        for sample, values in zip(samples, scores):
            sample.teacher_logprobs = values

    def close(self) -> None:
        """Stop the scoring threads (``ScoringPool.close``)."""
        self.pool.close()


def _response_logprobs(server: ServerClient, sample: Sample) -> list[float]:
    """The teacher's log-prob of each of ``sample``'s response tokens, scored by ``server``."""
    tokens = list(sample.prompt_ids) + list(sample.response_ids)
    values = prompt_logprob_values(server.probe(tokens), tokens, server.name)
    return values[len(sample.prompt_ids) - 1:]
