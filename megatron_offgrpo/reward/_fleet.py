"""Reward models on a fleet of their own (``offgrpo fleet start --model MODEL``, any size and layout): a classifier
served by vLLM's pooling runner, a judge by its generate runner. Requests spread over the servers and fail over
(``rollout.ScoringPool``, the teacher fleet's too), each bounded by ``reward.timeout_s`` per server."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_offgrpo.rollout import ScoringPool, ServerClient
from megatron_offgrpo.reward._types import ModelScore, ScoreRequest

WHAT = "reward.fleet"


class FleetClassifier:
    """A one-label classifier's raw logit, from the fleet's ``/classify``."""

    def __init__(self, pool: ScoringPool) -> None:
        self.pool = pool

    @classmethod
    def from_state(cls, state: str | Path, timeout_s: float, parallel: int) -> FleetClassifier:
        return cls(ScoringPool.from_state(state, WHAT, "pooling", parallel, timeout_s))

    def score(self, requests: Sequence[ScoreRequest]) -> list[ModelScore]:
        values = self.pool.map(lambda server, r: server.classify(list(r.token_ids)), requests)
        return [ModelScore(value) for value in values]

    def close(self) -> None:
        self.pool.close()


class FleetJudgeModel:
    """A judge's replies from the fleet's servers (``ServerClient.reply``), one request per reply, all at once."""

    name = WHAT

    def __init__(self, pool: ScoringPool) -> None:
        self.pool = pool

    @classmethod
    def from_state(cls, state: str | Path, timeout_s: float, parallel: int) -> FleetJudgeModel:
        return cls(ScoringPool.from_state(state, WHAT, "generate", parallel, timeout_s))

    def replies(self, prompts: Sequence[list[int]], max_tokens: int, temperature: float, seeds: Sequence[int],
                top: int) -> list[tuple[list[int], dict[int, float]]]:
        def ask(server: ServerClient, item: tuple[list[int], int]) -> tuple[list[int], dict[int, float]]:
            return server.reply(item[0], max_tokens, temperature, item[1], top)

        return self.pool.map(ask, list(zip(prompts, seeds)))

    def close(self) -> None:
        self.pool.close()
