"""Sections of the config tree for what comes beside the trainer's core: multi-turn environments, on-policy
distillation and the supervised warm-up (``config.Config`` holds them; ``offgrpo config --reference`` reads the
docstrings here too)."""

from __future__ import annotations

import dataclasses

from megatron_offgrpo.config._choices import LoraSync, LoraTarget, RewardNormalize, RmLoss, UnparsedVerdict


@dataclasses.dataclass
class EnvConfig:
    """Multi-turn episodes: the environment the model talks to over several turns (tools, feedback)."""

    name: str | None = None
    """None: single-turn completions. "python_tool": math problems with a sandboxed Python tool the model may call
    (Qwen's <tool_call> format) before it answers; "feedback": told too low / too high, the model answers again (a
    right answer at turn k earns 0.5^(k-1)); or "package.module:Factory", a zero-argument callable returning an
    ``envs.Environment`` (reset / step / close). The reward is the environment's (the shipped ones use
    data.reward)."""
    max_turns: int = 4
    """Model turns per episode (>= 1); each is capped at rollout.max_new_tokens."""
    max_tokens: int | None = None
    """Response tokens per episode, the model's and the environment's together (null: rollout.max_new_tokens x
    max_turns); prompt + this must fit the model's context. Overlong shaping measures an episode against it."""
    step_timeout_s: float = 300.0
    """Seconds one call of the environment's code (its factory, reset, step, close) may take; then the run stops with
    a line naming the class and the method (the call is abandoned: a thread cannot be killed). It bounds how long a
    SIGTERM waits on a stuck environment: keep it under a preemption's grace period."""
    tool_cpu_s: float = 5.0
    """python_tool: CPU seconds of one tool run (then it is killed and the model reads the error)."""
    tool_wall_s: float = 10.0
    """python_tool: wall-clock seconds of one tool run."""
    tool_memory_mib: int = 512
    """python_tool: address space of one tool run, MiB."""
    tool_output_bytes: int = 4096
    """python_tool: output the model reads of one run (the rest is cut, marked)."""

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The response budget of an episode (``max_tokens``, by default ``max_new_tokens x max_turns``)."""
        return self.max_tokens if self.max_tokens is not None else max_new_tokens * self.max_turns


@dataclasses.dataclass
class DistillConfig:
    """On-policy distillation: a frozen teacher scores every sampled token; minus its per-token reverse KL is an
    advantage, alone or beside the reward's. The keys after the teacher's place need a teacher (one set away from its
    default without a teacher is refused: the run would ignore it)."""

    teacher_path: str | None = None
    """The teacher, a HF directory or hub id with the student's tokenizer (every student token at the same id: refused
    otherwise, naming the first difference), on the trainer's ranks at the student's TP/PP layout, scoring each
    step's micro-batches. None: no teacher there (see ``teacher_fleet``)."""
    teacher_fleet: str | None = None
    """Or the teacher served by a fleet of its own (the ``--state-dir`` of ``offgrpo fleet start --model TEACHER``),
    any size or layout: rank 0 has it score every sample's tokens when they are generated (prompt log-probs, at
    temperature 1: needs ``rollout.temperature=1``); its served directory's tokenizer is compared as
    ``teacher_path``'s where the trainer can read it. None: no teacher there. At most one of the two."""
    weight: float = 1.0
    """The distillation advantage's weight: A_t += weight * (log pi_teacher - log pi_student) at each sampled token."""
    reward_weight: float = 0.0
    """The reward's (group) advantage's weight beside it (0: pure distillation, every sample trained; > 0: both)."""
    discount: float = 0.0
    """gamma in [0, 1]: a token is also credited with later tokens' terms, gamma^(k-t) (0: each token its own)."""

    @property
    def on(self) -> bool:
        """Whether the run distills (a teacher on the trainer's ranks or on its own fleet)."""
        return bool(self.teacher_path or self.teacher_fleet)


@dataclasses.dataclass
class RewardConfig:
    """Rewards from models: a scalar reward model or a generative judge scores every completion on rank 0, alone or
    beside the rule reward (``data.reward``), each group as soon as it is generated. Whenever the prompts have answers,
    the rule's reward is also logged as the gold one, every step and on the held-out prompts, beside the model's
    (``offgrpo report`` draws them against each other: the gap is the over-optimisation). Single-turn only."""

    model: str | None = None
    """A scalar reward model: a HF directory or hub id of a sequence classifier with one label (a Bradley-Terry RM,
    ``Qwen2ForSequenceClassification``), reading the policy's prompt and completion; its logit is the score. None:
    none (see ``judge``)."""
    judge: str | None = None
    """Or a generative judge: a HF causal LM (an instruct model) asked through ``judge_template`` whether each
    completion is right; its verdict is the score. At most one of ``model`` and ``judge``."""
    fleet: str | None = None
    """Where ``model`` or ``judge`` runs: the ``--state-dir`` of ``offgrpo fleet start --model MODEL`` (any size and
    layout; a classifier is served with vLLM's pooling runner), its requests spread over the servers, a failing
    server's going to the others. None: in rank 0's process (transformers, on CPU: small models)."""
    judge_template: str = "yes_no"
    """"yes_no" (is the response right? yes 1, no 0), "score_10" (a grade 0..10, divided by 10), or a file whose
    first line is "verdict: yes_no" or "verdict: score_10" and whose rest is the judge's message with {question},
    {response} and optionally {reference} (the ground truth), each alone inside its own <tag>...</tag> pair. The
    fields are data: "<" and ">" in them are escaped, so no text of the policy's closes a tag; the verdict is read
    from the judge's reply only."""
    judge_soft: bool = True
    """yes_no: the score is P(yes) / (P(yes) + P(no)) from the verdict token's log-probs where the reply begins with a
    verdict (the hard 1 / 0 otherwise)."""
    judge_max_tokens: int = 8
    """Tokens of the judge's reply (the verdict must begin it)."""
    judge_temperature: float = 0.0
    """0: the judge replies greedily; > 0: sampled with a seed derived from the sample (its prompt and response), so
    the same sample gets the same verdict."""
    unparsed: UnparsedVerdict = "zero"
    """A reply without a verdict (counted: ``reward_model_unparsed``): "zero" scores it 0; "resample" asks again
    with another seed, up to ``judge_attempts`` times, then 0."""
    judge_attempts: int = 3
    """unparsed=resample: replies asked of the judge per sample, at most."""
    rule_weight: float = 1.0
    """The rule reward's weight in the reward trained on: reward = rule_weight * rule + model_weight * score. 0: the
    model's score alone (the rule's is still logged as gold when the prompts have answers)."""
    model_weight: float = 1.0
    """The model's score's weight (after ``clip`` and ``normalize``)."""
    clip: float | None = None
    """The score is clipped to [-clip, clip] before it is weighted (an RM's logits are unbounded). None: not clipped."""
    normalize: RewardNormalize = "none"
    """"group": the score is standardised within each group of G (mean 0, std 1; a group of equal scores gets 0)
    before it is weighted, so its scale matches the rule's; "none": as the model gives it."""
    overlap: bool = True
    """Each group is scored as soon as it is generated, while the others generate (engines that generate
    concurrently: vLLM in process or a fleet); false: once the step's whole round is generated."""
    timeout_s: float = 120.0
    """Seconds one scoring request may take on a fleet server; then it goes to the next server (every server failing
    a sample stops the run naming it)."""

    @property
    def on(self) -> bool:
        """Whether a model scores the completions."""
        return bool(self.model or self.judge)


@dataclasses.dataclass
class SftConfig:
    """The supervised warm-up (`offgrpo sft` only)."""

    off_by_one_fraction: float = 0.0
    """Fraction of warm-up answers given as the ground truth plus one (integer answers; 0: never): a teacher more often
    wrong than right leaves a model that samples but does not decode the right answer, which the demo's RL learns."""


@dataclasses.dataclass
class RmConfig:
    """Fitting a scalar reward model (`offgrpo rm` only) from the policy's own labelled samples: the policy in
    model.hf_path samples rollout.group_size completions per prompt at rollout.temperature, the rule reward
    (data.reward) labels each right (reward >= 1) or wrong, and a one-label sequence classifier initialised from the
    policy (a new score head) learns to tell them apart: train.steps steps at optim.lr (constant), seeded by
    parallel.seed, on CPU. Held out: the first train.eval_prompts prompts of the eval split, labelled the same way."""

    prompts: int | None = None
    """Distinct training questions sampled (the first N of the training stream, repeats skipped); null: all."""
    groups_per_step: int = 4
    """Groups (one prompt's completions) per optimizer step."""
    loss: RmLoss = "pairwise"
    """"pairwise": Bradley-Terry within each group, -log sigmoid(s_right - s_wrong) over its right x wrong pairs (only
    mixed groups count). A pair shares its prompt, so the loss can only fall by reading the answer: on the demo it
    generalised to held-out questions (within-group accuracy 0.79) where "bce" learnt each training question's odds
    (0.45). The score is a ranking, its offset arbitrary: use it with reward.normalize=group. "bce": each completion's
    logit against its label (every group counts; the logit is the log-odds of right, for an RM read on its own)."""
    freeze_embeddings: bool = True
    """Keep the token embeddings as the policy's: on a small vocabulary of a task they are most of the parameters
    (the tiny model: 19.4M of 20M) and few of their rows ever get a gradient, so they would cost time and memory
    without changing what the classifier reads."""


@dataclasses.dataclass
class LoraConfig:
    """Low-rank adapters on the policy, the base frozen (no gradient, no optimizer state for it), and what each
    refresh sends the engines."""

    rank: int = 0
    """r of every adapter; 0: off (full fine-tuning). RL carries little information per step: rank 1 already matches
    full fine-tuning on GRPO ("LoRA Without Regret", Thinking Machines 2025) at about 10x its learning rate."""
    alpha: float = 32.0
    """The update is scaled by alpha / rank (PEFT's lora_alpha); a fixed alpha keeps the best learning rate about the
    same across ranks."""
    dropout: float = 0.0
    """Dropout on each adapter's input while training (PEFT's lora_dropout); 0 keeps the trainer's log-probs those of
    the engine's."""
    targets: list[LoraTarget] | None = None
    """The linear layers that get an adapter (megatron's names: linear_qkv holds q/k/v, linear_fc1 gate/up).
    null: all four on dense models, the attention's two on Qwen3-MoE (whose MLP is its experts)."""
    sync: LoraSync = "adapter"
    """What each refresh sends: "adapter" (the engines serve base + adapter with vLLM's LoRA; a few MB), or "merged"
    (base + scaling B A through the full refresh: engines without LoRA)."""
