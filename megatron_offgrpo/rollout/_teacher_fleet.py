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

import concurrent.futures
import itertools
import logging
from pathlib import Path
from typing import Sequence

from megatron_offgrpo.data import Sample
from megatron_offgrpo.rollout._errors import FleetError
from megatron_offgrpo.rollout._samples import prompt_logprob_values
from megatron_offgrpo.rollout._server import ServerClient, servers_of

logger = logging.getLogger(__name__)


class TeacherFleet:
    """The servers of a teacher's fleet, and the scoring of a step's samples on them."""

    def __init__(self, servers: list[ServerClient], requests_at_once: int = 32) -> None:
        """Raises ``FleetError`` when no server answers ``/health``."""
        self.servers = [s for s in servers if s.health()]
        if not self.servers:
            raise FleetError(f"distill.teacher_fleet: no server of {[s.name for s in servers]} answers /health: "
                             "start the teacher's fleet (offgrpo fleet start --model TEACHER --state-dir DIR)")
        self._pool = concurrent.futures.ThreadPoolExecutor(requests_at_once, thread_name_prefix="offgrpo-teacher")
        self._next = itertools.count()

    @classmethod
    def from_state(cls, state: str | Path) -> TeacherFleet:
        """Connect to the teacher's fleet that ``offgrpo fleet start`` recorded (its state directory or file)."""
        from megatron_offgrpo.fleet import load_state

        return cls(servers_of(load_state(state)))

    def score(self, samples: Sequence[Sample]) -> None:
        """Set each sample's ``teacher_logprobs``: the teacher's log-prob of each response token.

        Raises:
            FleetError: a sample that no server could score.
        """
        futures = [self._pool.submit(self._score_one, sample, next(self._next)) for sample in samples]
        for sample, future in zip(samples, futures):
            sample.teacher_logprobs = future.result()

    def _score_one(self, sample: Sample, turn: int) -> list[float]:
        tokens = list(sample.prompt_ids) + list(sample.response_ids)
        errors = []
        for k in range(len(self.servers)):  # this request's server first, then the others in turn
            server = self.servers[(turn + k) % len(self.servers)]
            try:
                values = prompt_logprob_values(server.probe(tokens), tokens, server.name)
            except Exception as exc:  # noqa: BLE001 - any failure of one server: the next one scores it
                errors.append(f"{server.name}: {type(exc).__name__}: {exc}")
                continue
            if errors:
                logger.warning("teacher fleet: %s failed (%s); %s scored the sample", errors[0].split(":")[0],
                               errors[0], server.name)
            return values[len(sample.prompt_ids) - 1:]  # the response tokens' log-probs
        raise FleetError(f"teacher fleet: no server scored sample {sample.prompt_id}/{sample.group_id}: {errors}")

    def close(self) -> None:
        """Stop the scoring threads: the requests not started are dropped, those in flight end within their HTTP
        timeout (the servers belong to ``offgrpo fleet stop``)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
