"""The data types that cross the rollout/train wall: prompts go out to the fleet, samples come back.

``Sample`` is the only object the rollout side hands to the trainer (slime's ``Sample`` habit). It carries the
fleet's per-token log-probs and the policy version that produced it, so the trainer can compute staleness and
importance ratios against the behavior policy.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt, tokenised with the chat template, with what its reward needs.

    Attributes:
        prompt_id: stable id within the dataset (e.g. "gsm8k/train/17"): the data position and the group key.
        prompt_ids: [T_prompt] token ids, chat template applied.
        text: the raw question (for logs and rewards that read it).
        answer: the ground truth the reward function checks (e.g. "72"), or None for reward models.
        max_new_tokens: this prompt's own cap on its completions (a data row's ``max_new_tokens``), under the run's
            (``rollout.max_new_tokens``); None: the run's.
    """

    prompt_id: str
    prompt_ids: tuple[int, ...]
    text: str = ""
    answer: str | None = None
    max_new_tokens: int | None = None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` with this prompt's completion cap applied (what every engine asks for it)."""
        if self.max_new_tokens is None or self.max_new_tokens >= params.max_tokens:
            return params
        return dataclasses.replace(params, max_tokens=self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How the fleet samples completions.

    Attributes:
        max_tokens: longest completion. temperature, top_p, top_k: sampling (temperature 0 = greedy).
        seed: per-request seed (None = engine's). stop_token_ids: extra ids that end a completion (EOS always does).
        priority: when the engine admits the request, not how it samples: vLLM's priority scheduling, lower first,
            equal ones in arrival order. ``rollout.mode=async`` gives each step's requests the step's number, so
            when the batch is full the oldest step's waiting requests take the freed slots before any later step's.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0


@dataclasses.dataclass
class Sample:
    """One completion of one prompt, or one multi-turn episode (its turns and the environment's answers, in order).

    Attributes:
        prompt_id: the prompt's id. group_id: index of the prompt's group in the batch (the G samples of a
            prompt share it). prompt_ids: [T_prompt]. response_ids: [T_resp] sampled tokens.
        behavior_logprobs: [T_resp] the fleet's log-prob of each sampled token (the behavior policy's).
        reward: set by the scorer (None before scoring), shaping included.
        shaping: the part of ``reward`` that is shaping, not the task's score (e.g. the overlong penalty, <= 0).
        policy_version: the trainer step whose weights generated every token of this sample; with
            ``token_versions``, the oldest of them (the staleness bound holds on it).
        token_versions: [T_resp] the version that sampled each response token, when a refresh came while the
            sample was being generated (``rollout.mode=async_partial``); None when one version made them all.
        finish_reason: "stop" (EOS/stop token) or "length" (hit max_tokens).
        server: which engine/server produced it (for logs and failover checks).
        attempts: the requests its group took: 1, or more when a server failed with the group in flight and it was
            sent again (generated anew on another server; nothing of the failed attempt is kept).
        trainable: [T_resp] True where the response token is the model's own (it enters the loss), False where an
            environment wrote it (a multi-turn episode's tool results and feedback: context, never trained; their
            ``behavior_logprobs`` are 0); None: every response token is the model's (single-turn). The turn
            boundaries: each maximal run of True is one model turn (an observation always separates two turns).
        turns: the model turns of a multi-turn episode (1 for a single completion).
        teacher_logprobs: [T_resp] on-policy distillation's teacher's log-prob of each response token, when a
            teacher's fleet scored the sample (``distill.teacher_fleet``); None otherwise (no teacher, or one on the
            trainer's ranks, which scores the step's micro-batches itself).
        gold_reward: the rule reward (``data.reward``) when a reward model scores the sample and its prompt has an
            answer: the gold the model's reward is held against (None otherwise; ``reward`` is then the rule's).
        model_score: the reward model's score, before ``reward.clip`` and ``normalize`` (None without one).
        model_parsed: False when a judge's replies held no verdict (``model_score`` is then 0).
        routed_experts: MoE engines that record routing (``model.router_replay``): ``[P + R - 1, layers, top_k]``
            integer tensor, the experts each layer routed each input position to (the prompt and every sampled
            token but the last, which was never fed back); the trainer's forward replays them. None otherwise.
    """

    prompt_id: str
    group_id: int
    prompt_ids: list[int]
    response_ids: list[int]
    behavior_logprobs: list[float]
    policy_version: int
    finish_reason: str
    reward: float | None = None
    server: str = ""
    shaping: float = 0.0
    routed_experts: Any = None  # torch.Tensor | None (this room's types stay importable without torch)
    token_versions: list[int] | None = None
    attempts: int = 1
    trainable: list[bool] | None = None
    turns: int = 1
    teacher_logprobs: list[float] | None = None
    gold_reward: float | None = None
    model_score: float | None = None
    model_parsed: bool = True

    def __post_init__(self) -> None:
        if len(self.behavior_logprobs) != len(self.response_ids):
            raise ValueError(
                f"sample {self.prompt_id}/{self.group_id}: {len(self.behavior_logprobs)} log-probs for "
                f"{len(self.response_ids)} response tokens: the engine must return one log-prob per sampled token"
            )
        if self.token_versions is not None and (len(self.token_versions) != len(self.response_ids)
                                                or min(self.token_versions) != self.policy_version):
            raise ValueError(f"sample {self.prompt_id}/{self.group_id}: {len(self.token_versions)} token versions "
                             f"(oldest {min(self.token_versions, default=None)}) for {len(self.response_ids)} response "
                             f"tokens of policy_version {self.policy_version}")
        if self.trainable is not None and len(self.trainable) != len(self.response_ids):
            raise ValueError(f"sample {self.prompt_id}/{self.group_id}: {len(self.trainable)} trainable flags for "
                             f"{len(self.response_ids)} response tokens")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.response_ids):
            raise ValueError(f"sample {self.prompt_id}/{self.group_id}: {len(self.teacher_logprobs)} teacher log-probs "
                             f"for {len(self.response_ids)} response tokens")
        positions = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routed_experts is not None and self.routed_experts.shape[0] != positions:
            raise ValueError(f"sample {self.prompt_id}/{self.group_id}: routing of {self.routed_experts.shape[0]} "
                             f"positions for {positions} input positions (prompt + response less its last token)")

    def trained_tokens(self) -> int:
        """The response tokens that enter the loss (the model's own)."""
        return len(self.response_ids) if self.trainable is None else sum(self.trainable)
