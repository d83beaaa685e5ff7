"""The sections of the trainer's core, the root ``Config`` and ``load_config``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_offgrpo.config._choices import (
    RENAMED, AdvantageForm, Aggregation, BehaviorLogprobs, CompileMode, DataSource, DeltaCompression, EngineDtype,
    EngineKind, Fp8Recipe, KlEstimator, Logger, ModelInit, Precision, PromptFormat, RecClip, RecWeight, RolloutMode,
    SyncKind, TisLevel, TransportKind)
from megatron_offgrpo.config._load import apply_values, parse_override, read_recipe
from megatron_offgrpo.config._sections import (DistillConfig, EnvConfig, LoraConfig, RewardConfig, RmConfig,
                                               SftConfig)


@dataclasses.dataclass
class ModelConfig:
    """What to train."""

    hf_path: str = ""
    """HF model directory (config.json [+ weights]) or hub id."""
    init: ModelInit = "hf"
    """"hf": hf_path's weights; "random": init from its config (demos); "megatron": megatron_path's, at any layout."""
    megatron_path: str = ""
    """init=megatron: a megatron dist checkpoint (hf-to-megatron's, Megatron-LM's --save, a run); hf_path: tokenizer."""
    precision: Precision = "fp32"
    """"fp32" | "bf16" (bf16 params, fp32 main weights/grads in the optimizer) | "fp8" (needs Transformer Engine)."""
    fp8_recipe: Fp8Recipe = "delayed"
    """FP8 scaling recipe when precision=fp8 (Transformer Engine's recipes of those names)."""
    fp8_amax_history: int = 1024
    """Amax history length of the delayed recipe."""
    fp8_margin: int = 0
    """FP8 scaling margin."""
    moe_aux_loss_coef: float | None = None
    """MoE models: weight of megatron's load-balancing loss (None: the HF config's router_aux_loss_coef; 0: off)."""
    compile: bool = False
    """torch.compile each decoder layer of the trained stage (one graph serves every layer; the first step compiles
    it, tens of seconds): inductor fuses the local spec's norms, rotary and SwiGLU. tp=1, no fp8. README "GPU"."""
    compile_mode: CompileMode = "default"
    """With compile: torch.compile's mode. "default"; "reduce-overhead": the compiled layers also replay as CUDA
    graphs (GPUs; the step has no host synchronisation, which graphs need): no host launches bound the step."""
    grad_accum_fusion: bool | None = None
    """Weight-gradient GEMMs accumulate into the fp32 main grads (megatron's gradient_accumulation_fusion; TE's,
    apex's or a torch stand-in), no 16-bit grad cast and added per micro-batch. None: on with TE's layers only."""
    router_replay: bool = False
    """MoE models: the engine records the experts each layer routed every token to, and the trainer's forwards replay
    them (the train/inference routing mismatch removed). Every engine records them. vLLM on GPUs returns them itself
    (a fleet started with ``--record-routing``); vLLM CPU records them in eager mode with prefix caching off (the
    same flag), so each sample computes its own prompt."""


@dataclasses.dataclass
class ParallelConfig:
    """How the trainer is split over ranks: world = tp * pp * dp (ep splits dp for the experts)."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    ep: int = 1
    """Expert-parallel size (MoE models): each of ep ranks holds num_experts/ep experts of every layer; etp x ep
    divides world / pp."""
    etp: int | None = None
    """Expert-tensor-parallel size (MoE models): each expert's weights are split over etp ranks (null: tp). etp=1
    keeps every expert whole, and EP can then span the TP ranks (tp=2, etp=1, ep=2 on 2 ranks)."""
    sequence_parallel: bool | None = None
    """Megatron's sequence parallelism (needs tp > 1): norms, residuals and MoE routing run on s/tp positions of each
    row, with an all-gather / reduce-scatter over TP around attention and the MLP in place of an all-reduce; rows are
    padded to a multiple of tp (pads carry no loss). null: on for MoE models at tp > 1 (megatron trains MoE layers
    with tp > 1 only so), off otherwise; false with a MoE model at tp > 1 is an error."""
    seed: int = 1234
    """Base seed (model-parallel RNG streams, prompt shuffling, sampling)."""


@dataclasses.dataclass
class DataConfig:
    """Prompts and their verifiable reward."""

    name: str = "gsm8k"
    """"gsm8k", "arithmetic", or a hub dataset id."""
    split: str = "train"
    """Training split (arithmetic: "train" is its training questions, any other split its held-out ones)."""
    eval_split: str = "test"
    """Split used by `offgrpo eval` and periodic evaluation (arithmetic: the held-out fifth of the questions, chosen by
    a hash of the question, which training never sees). Ignored with data.path or data.eval_path."""
    source: DataSource = "auto"
    """Where a named dataset comes from: "local" its bundled copy, "hub" the Hugging Face hub, "auto" the bundled
    copy where there is one, else the hub."""
    path: str | None = None
    """Local JSONL/JSON/Parquet overriding the bundled copy (or the arithmetic task). Without data.eval_path, a fifth
    of its distinct questions (by a hash of the question) is held out for evaluation and never trained on (the start
    log says so). A row may carry ``max_new_tokens``: its own cap on its completions, under rollout.max_new_tokens."""
    eval_path: str | None = None
    """Local JSONL/JSON/Parquet file to evaluate on (`offgrpo eval` and periodic evaluation), instead of
    data.eval_split or data.path's held-out slice. Questions it shares with the training data are counted
    (run_info.json's data.eval_overlap) and warned about."""
    question_key: str = "question"
    """Row key of the question."""
    answer_key: str = "answer"
    """Row key of the ground truth."""
    count: int = 2000
    """Number of synthetic records (arithmetic only)."""
    max_operand: int = 20
    """Largest operand (arithmetic only): (max_operand + 1)^2 distinct questions, a fifth of them held out (>= 1)."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are an error (checked before the run starts, naming the file and line)."""
    prompt_format: PromptFormat = "chat"
    """"chat": the tokenizer's chat template; "plain": system prompt, question and instruction as plain lines, no
    special tokens (base models)."""
    system_prompt: str | None = None
    """System message (None: the tokenizer template's default; none in the plain format)."""
    instruction: str = "Solve the problem. Put the final numeric answer after '####'."
    """Appended to every question."""
    reward: str = "math_exact"
    """Registered reward name (math_exact, math_strict) or "package.module:function" for your own."""


@dataclasses.dataclass
class RolloutConfig:
    """Generation: engine, group size, sampling, and how often its weights are refreshed."""

    engine: EngineKind = "auto"
    """"fleet" (vLLM servers) | "vllm" (in-process) | "transformers" | "auto" (vLLM if installed, else transformers)."""
    dtype: EngineDtype = "auto"
    """What the in-process engines (vllm, transformers) generate in: "auto" (float32 with model.precision=fp32, else
    bfloat16) | "float32" | "bfloat16". bfloat16 under an fp32 trainer decodes faster on CPUs with bf16 GEMMs
    (avx512_bf16, AMX) but its behavior log-probs carry bf16 rounding: the ``log_ratio_abs_mean`` metric reports the
    gap, ``algo.tis_cap`` corrects for it, and the refresh probe is checked at bf16's tolerance. A fleet generates in
    the dtype it was started with (the fleet's ``--dtype`` flag)."""
    fleet_state: str | None = None
    """The fleet's state directory written by `offgrpo fleet start` (engine=fleet): its servers and token."""
    prompts_per_step: int = 8
    """B: prompts per optimizer step."""
    group_size: int = 8
    """G: completions per prompt (>= 2: advantages are group-relative)."""
    max_new_tokens: int = 256
    """Longest completion."""
    temperature: float = 1.0
    """Sampling temperature (the loss uses the same temperature for log-probs)."""
    top_p: float = 1.0
    """Must be 1.0 (no nucleus): an unchanged policy's ratio to a nucleus-sampled token would be the nucleus's mass."""
    refresh_every: int = 1
    """v: refresh the engine's weights every v optimizer steps (1 = on-policy)."""
    transport: TransportKind = "disk"
    """Weight refresh transport: "disk" | "collective" | "shm" (servers on the trainer's machine)."""
    bucket_mb: int = 256
    """Bucket size of the collective and shm transports."""
    sync: SyncKind = "full"
    """What a refresh sends: "full" (every tensor) | "delta" (per tensor only the elements whose value in the engine's
    dtype changed since the last version sent, checksummed, applied only onto that version; the engine that cannot
    apply one gets the version whole). Costs one copy of the model in the engine's dtype in the trainer's global rank 0
    memory and in every engine worker's (CPU). Engines vllm, fleet and auto with vLLM (a fleet: set rollout.dtype to
    its --dtype); not with lora.sync=adapter (the adapter is already small)."""
    full_sync_every: int = 20
    """rollout.sync=delta: a full sync every this many refreshes (besides the first of a start or resume, and one for
    every engine that restarted, joined or refused a delta). 20: the chain is reset at a ~5% cost in bytes when a
    delta is a tenth of the model."""
    delta_compression: DeltaCompression = "none"
    """rollout.sync=delta: "none" | "zlib" (level 1) over each delta's positions and values. Positions go as 2-byte
    gaps, so zlib saves a further 17-35% of the bytes for 15-40% more encode time (docs/benchmarks.md): worth it
    where the transport is slower than ~50 MB/s."""
    shm_dir: str = "/dev/shm"
    """RAM-backed directory the shm transport keeps one copy of the model in (the servers must see it too)."""
    collective_host: str | None = None
    """transport=collective: the host name or IP of rank 0's node that the fleet's workers dial. None: 127.0.0.1 when
    every server is on this machine, else rank 0's host name."""
    behavior_logprobs: BehaviorLogprobs = "fleet"
    """"fleet": the engine's log-probs; "recompute": recomputed from a snapshot of the pushed weights (exact)."""
    mode: RolloutMode = "lockstep"
    """How generation and training take turns: one choice (it was three keys: mode, overlap, partial_rollouts).
    "lockstep": each step generates its batch, then learns (staleness <= v - 1). "overlap": step k+1's batch generates
    while step k learns (staleness <= v, enforced). "async": the next steps generate while the trainer learns, as far
    ahead as ``max_staleness`` allows (then it pauses, nothing is discarded), at once on vLLM and the fleet; trained in
    draw order; checkpoints keep the untrained batches. "async_partial": async on vLLM (in-process or fleet) where a
    refresh comes between two decode steps of the steps in flight, which go on under the new weights, their KV
    recomputed (AReaL); each token keeps its version and behavior log-prob (the ratio's), the bound holds on a
    sample's oldest token. Not with router replay (docs/guide.md)."""
    max_staleness: int | None = None
    """The async modes: the oldest a trained sample may be, in optimizer steps (v - 1 to 64; null: v, which is then
    held to 64 too). Generation of step s waits until the engine's version w has s - w <= max_staleness. At most 64
    since every step the bound allows generates at once: B + 1 steps' requests, and their finished batches in memory
    and in each checkpoint (and a sample that stale barely moves the clipped objective). A number, not a mode: it is
    the one async setting with a range."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups with equal rewards (algo's zero-variance criterion) are discarded and the step
    refills from the prompt stream up to prompts_per_step groups with variance (changes the batch, not the loss)."""
    overlong_buffer: int = 0
    """DAPO's overlong shaping: reward falls linearly to -overlong_penalty over the last N tokens (0: off)."""
    overlong_penalty: float = 1.0
    """The overlong punishment at max_new_tokens (>= 0)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: responses cut at max_new_tokens leave the loss (not their group's baseline)."""
    max_sampling_rounds: int = 4
    """Most generation rounds of a dynamic_sampling step (>= 1); then discarded groups top the batch up (masked), and
    a step with no group with variance stops the run."""
    oversample: float = 1.0
    """Each dynamic_sampling round asks for ceil(missing groups x oversample) prompts (>= 1)."""
    verify_tolerance: float | None = None
    """Max |fleet - trainer| log-prob on the probe after a refresh. None: serving float32, the bound derived from the
    model (``rollout.probes.probe_bound``: the fp32 rounding of a log-softmax over the vocabulary plus the output
    layer's dot products at the weights' logit scale; 9.6e-3 for the warm-up model); bfloat16,
    ``rollout.probes.PROBE_ATOL``'s 5e-2; a fleet started with --dtype bfloat16 under an fp32 trainer needs 5e-2
    here."""

    def staleness_bound(self) -> int:
        """The oldest a trained sample may be, in steps (enforced every step): v - 1 in lockstep, v with overlap (the
        batch is generated during the previous step), ``max_staleness`` (default v) in the async modes."""
        if self.asynchronous():
            return self.refresh_every if self.max_staleness is None else self.max_staleness
        return self.refresh_every - 1 + int(self.mode == "overlap")

    def asynchronous(self) -> bool:
        """Generation runs ahead of the trainer on its own, under ``max_staleness`` (mode async or async_partial)."""
        return self.mode in ("async", "async_partial")

    def serving_dtype(self, precision: str) -> str:
        """The dtype the engine generates in and refreshes arrive in: ``dtype``, whose "auto" follows
        ``model.precision`` (fp8 and bf16 runs serve bf16)."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if precision == "fp32" else "bfloat16"

    def drgrpo_constant(self) -> float:
        """Dr.GRPO's constant (``algo.aggregation=token_sum_norm``): the longest possible response times the sequences
        of one step, ``max_new_tokens x prompts_per_step x group_size``. The one definition: the trainer builds its
        objective with it and validation checks the objective with it (a method, as ``_rules`` imports nothing
        of ours)."""
        return float(self.max_new_tokens * self.prompts_per_step * self.group_size)


@dataclasses.dataclass
class AlgoConfig:
    """The objective (see megatron_offgrpo.algo for every formula)."""

    objective: str = "grpo_clip"
    """grpo_clip | gpg | rec | opmd | asymre | cispo | gspo (gspo needs aggregation=seq_mean_token_mean)."""
    eps_low: float = 0.2
    """Lower clip: rho >= 1 - eps_low (cispo: the weight's floor; 1.0 = none)."""
    eps_high: float = 0.2
    """Upper clip: rho <= 1 + eps_high (cispo: the weight's cap)."""
    seq_eps_low: float = 3e-4
    """gspo: the sequence ratio's floor 1 - seq_eps_low (the paper's 3e-4; ceiling: seq_eps_high, 4e-4)."""
    seq_eps_high: float = 4e-4
    """gspo: the sequence ratio's ceiling 1 + seq_eps_high."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 for negative advantages (grpo_clip only)."""
    rec_weight: RecWeight = "none"
    """REC family weight: "none" (NoIS) or "is" (the importance ratio)."""
    rec_clip: RecClip = "none"
    """REC family: which tokens the ratio mask keeps (the REC paper's variants of those names)."""
    tau: float = 0.0
    """OPMD / AsymRE regulariser strength."""
    kl_estimator: KlEstimator = "k3"
    """Estimator of the KL to the reference policy (Schulman's k1, k2, k3)."""
    kl_beta: float = 0.0
    """KL coefficient (0: no reference model)."""
    tis_cap: float | None = None
    """Truncated IS cap C against the fleet's log-probs (None: off)."""
    tis_level: TisLevel = "token"
    """Truncated IS per token, or on the sequence's product of ratios."""
    aggregation: Aggregation = "token_mean"
    """How token losses become the step's loss: mean over tokens, mean over sequences of their token means, or sum over
    a constant (Dr.GRPO: ``rollout.drgrpo_constant``)."""
    advantage_form: AdvantageForm = "sqrt_var"
    """"sqrt_var": (r - mean)/sqrt(var + eps) (seed paper); "std_eps": (r - mean)/(std + eps)."""
    std_normalize: bool = True
    """Divide by the group spread (False = Dr.GRPO)."""
    leave_one_out: bool = False
    """Leave-one-out baseline."""
    gpg_scale: bool = False
    """GPG's B / max(1, #valid) scaling."""
    red_drop: bool = False
    """RED-Drop surplus negatives."""
    mask_zero_variance: bool = True
    """Groups whose rewards are all equal leave the loss and its normaliser."""

    # The one translation of this section into algo/'s parameters, used by the trainer and by validation (algo is
    # pure math; imported lazily so that reading a recipe stays torch-free). algo's dataclasses validate themselves.
    def objective_params(self, aggregation_constant: float | None = None):
        """The loss switches (``algo.ObjectiveParams``); ``aggregation_constant``: Dr.GRPO's (token_sum_norm)."""
        from megatron_offgrpo.algo import ObjectiveParams

        return ObjectiveParams(
            objective=self.objective, eps_low=self.eps_low, eps_high=self.eps_high, seq_eps_low=self.seq_eps_low,
            seq_eps_high=self.seq_eps_high, dual_clip=self.dual_clip,
            rec_weight=self.rec_weight, rec_clip=self.rec_clip, tau=self.tau, kl_estimator=self.kl_estimator,
            kl_beta=self.kl_beta, tis_cap=self.tis_cap, tis_level=self.tis_level, aggregation=self.aggregation,
            aggregation_constant=aggregation_constant,
        )

    def advantage_params(self):
        """The advantage-estimator switches (``algo.AdvantageParams``)."""
        from megatron_offgrpo.algo import AdvantageParams

        return AdvantageParams(
            form=self.advantage_form, std_normalize=self.std_normalize, leave_one_out=self.leave_one_out,
            gpg_scale=self.gpg_scale, red_drop=self.red_drop, mask_zero_variance=self.mask_zero_variance,
        )


@dataclasses.dataclass
class OptimConfig:
    """Megatron optimizer."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate (cosine)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0: off)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks."""
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch: rows as long as the step's longest sequence, as many as fit."""
    packing: bool = False
    """Pack whole sequences into each micro-batch row (padding only at a row's end; a block-diagonal causal mask keeps
    each to itself; groups dealt to DP ranks by tokens) instead of one sequence per row padded to the longest: fewer
    positions, the same gradient (benchmarks/packing.py). Packs the `offgrpo sft` warm-up too. Local layer spec only:
    refused where Transformer Engine is in use (its causal attention ignores the mask; its THD path is not wired
    yet)."""
    shared_prompt: bool = False
    """With packing: compute a group's prompt once for its G samples (the prompt, then each response as a branch that
    sees the prompt and itself: a tree mask; rotary angles from position ids): G - 1 fewer copies of every prompt, the
    same gradient. A group whose prompts differ is packed as whole sequences. Local layer spec only, as packing (TE's
    attention cannot take a tree mask at all)."""


@dataclasses.dataclass
class TrainConfig:
    """The run."""

    steps: int = 100
    """Optimizer steps."""
    out_dir: str = "runs/default"
    """Run directory: config, metrics (JSONL, TensorBoard), checkpoints, plots. Locked while a run writes it (a
    second run into it is refused); not empty, not a file nor under one."""
    save_every: int = 50
    """Checkpoint every N steps (0: only at the end)."""
    async_save: bool = False
    """Write checkpoints in the background: the step goes on once the tensors are staged (copied to host memory: from
    the GPU, or within the host on CPU) for a forked writer, and the checkpoint appears, whole, once every rank wrote
    it: at the latest before the next save, a load, a stop or the end. The host holds one more copy of this rank's
    model and optimizer state (on CPU from the first save on: its copies are refilled by each save)."""
    export_every: int = 0
    """Also write the policy as a HF directory every N steps, out_dir/exports/step_N (0: only the final out_dir/hf,
    which every run writes after its last step)."""
    eval_every: int = 0
    """Evaluate every N steps (0: never)."""
    eval_prompts: int = 200
    """Prompts per evaluation."""
    eval_samples: int = 1
    """n > 1: also sample n completions per eval prompt and report eval_pass@k (k = 1, 2, 4, ..., n), eval_avg@n."""
    resume: bool = False
    """Continue from the newest complete checkpoint in out_dir (step 0, saying so, when there is none)."""
    overwrite: bool = False
    """A new run (also offgrpo sft) into an out_dir holding an earlier run: false refuses; true moves it aside to
    OUT_DIR.replaced-TIMESTAMP (nothing deleted). Refused where out_dir holds the cwd, the checkout or hf_path."""
    deterministic: bool = False
    """Deterministic algorithms (CPU: bit-reproducible resume)."""
    max_nonfinite_steps: int = 3
    """Stop after this many non-finite losses in a row (each one is skipped and logged)."""
    log_every: int = 1
    """Console progress line every N steps (and the last); metrics.jsonl and the trackers get every step."""
    loggers: list[Logger] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    """Trackers beside RUN/metrics.jsonl (always written), each getting every metric, the config and the samples:
    tensorboard (RUN/tensorboard), wandb, mlflow (pip install 'megatron-offgrpo[tracking]'); [] for none."""
    project: str = "megatron-offgrpo"
    """The wandb project / mlflow experiment of the run."""
    run_name: str | None = None
    """The run's name in wandb / mlflow (None: out_dir's last component)."""
    samples_every: int = 10
    """At steps 0, N, 2N, ...: the first 2 groups' completions (prompt, response, reward, policy version, finish
    reason, length) to RUN/samples.jsonl and to each tracker as a table (0: never)."""


@dataclasses.dataclass
class Config:
    """The root of the tree."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    sft: SftConfig = dataclasses.field(default_factory=SftConfig)
    rm: RmConfig = dataclasses.field(default_factory=RmConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (saved with every run)."""
        return dataclasses.asdict(self)

    def validate(self) -> None:
        """Check every cross-field rule; raise one ``ValueError`` listing all violations, each naming its keys."""
        from megatron_offgrpo.config._rules import collect_errors

        errors = collect_errors(self)
        if errors:
            raise ValueError("invalid config:\n  " + "\n  ".join(errors))


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML recipe at ``path``, then ``key=value`` overrides; validated.

    Raises:
        ConfigError: unknown key or wrong type (naming the key). ValueError: cross-field rules.
    """
    config = Config()
    if path is not None:
        apply_values(config, read_recipe(path), "", RENAMED)
    for text in overrides:
        apply_values(config, parse_override(text), "", RENAMED)
    config.validate()
    return config
