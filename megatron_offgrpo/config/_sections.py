"""Sections of the config tree for what comes beside the trainer's core: multi-turn environments, on-policy
distillation and the supervised warm-up (``config.Config`` holds them; ``offgrpo config --reference`` reads the
docstrings here too)."""

from __future__ import annotations

import dataclasses

from megatron_offgrpo.config._choices import LoraSync, LoraTarget


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
class SftConfig:
    """The supervised warm-up (`offgrpo sft` only)."""

    off_by_one_fraction: float = 0.0
    """Fraction of warm-up answers given as the ground truth plus one (integer answers; 0: never): a teacher more often
    wrong than right leaves a model that samples but does not decode the right answer, which the demo's RL learns."""


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
