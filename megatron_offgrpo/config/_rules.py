"""Cross-field rules of ``Config.validate()``: each returns messages naming the keys, the values and the fix.

``config`` below is the root ``megatron_offgrpo.config.Config``, imported for its type only (``_tree`` imports this
module). A choice key's values are its field's ``Literal`` type, read by ``_choice_errors``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from megatron_offgrpo.config._load import choices, field_types, long_component

if TYPE_CHECKING:
    from megatron_offgrpo.config._sections import DistillConfig, EnvConfig, RewardConfig
    from megatron_offgrpo.config._tree import Config, ParallelConfig, RolloutConfig

WILDCARDS = ("0.0.0.0", "::", "[::]", "*")  # bind-all addresses: a server listens on them, a client cannot dial them
PATHS = ["model.hf_path", "model.megatron_path", "data.path", "data.eval_path", "rollout.fleet_state",
         "rollout.shm_dir", "distill.teacher_path", "distill.teacher_fleet",
         "reward.model", "reward.judge", "reward.fleet"]
"""The keys that name files or directories (``train.out_dir``: the run directory's own check, ``runlog._run_dir``)."""
POSITIVE = ["parallel.tp", "parallel.pp", "parallel.ep", "rollout.prompts_per_step", "rollout.max_new_tokens",
            "rollout.refresh_every", "rollout.full_sync_every", "rollout.bucket_mb", "rollout.max_sampling_rounds",
            "optim.micro_batch_tokens",
            "train.steps", "train.max_nonfinite_steps", "train.log_every", "train.eval_prompts", "train.eval_samples",
            "data.max_prompt_tokens", "data.count", "rm.groups_per_step"]


def _get(config: Config, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def collect_errors(config: Config) -> list[str]:
    """All violated rules of ``config`` (empty when valid)."""
    errors = _nonfinite_errors(config)
    if errors:  # every other rule compares numbers: a NaN passes them all
        return errors
    errors.extend(_choice_errors(config))
    errors.extend(_path_errors(config))
    for key in POSITIVE:
        if _get(config, key) < 1:
            errors.append(f"{key}={_get(config, key)}: must be >= 1")
    for rules in (_sampling_errors, _rollout_mode_errors, _model_errors, _optim_errors, _train_errors, _algo_errors):
        errors.extend(rules(config))
    errors.extend(_parallel_errors(config.parallel))
    errors.extend(_env_errors(config.env))
    errors.extend(_distill_errors(config.distill, config.rollout.temperature))
    errors.extend(_lora_errors(config))
    errors.extend(_reward_errors(config.reward, config.env.name))
    if config.rm.prompts is not None and config.rm.prompts < 1:
        errors.append(f"rm.prompts={config.rm.prompts}: must be >= 1 (null: every distinct training question)")
    return errors


def _lora_errors(config: Config) -> list[str]:
    """The adapters' sizes, and ``lora.*`` keys set with LoRA off (rank 0: full fine-tuning would ignore them)."""
    lora, errors = config.lora, []
    if lora.rank < 0:
        errors.append(f"lora.rank={lora.rank}: must be >= 0 (0: full fine-tuning)")
    if lora.rank <= 0:
        return errors + [f"lora.{f.name}={getattr(lora, f.name)} does nothing with lora.rank=0 (full fine-tuning): "
                         "set lora.rank >= 1 for adapters, or drop the key"
                         for f in dataclasses.fields(lora) if f.name != "rank" and getattr(lora, f.name) != _default(f)]
    if not lora.alpha > 0:
        errors.append(f"lora.alpha={lora.alpha}: must be > 0 (the update is scaled by alpha / rank)")
    if not 0 <= lora.dropout < 1:
        errors.append(f"lora.dropout={lora.dropout}: must be in [0, 1)")
    if lora.targets is not None and (not lora.targets or len(set(lora.targets)) < len(lora.targets)):
        errors.append(f"lora.targets={lora.targets}: give each linear layer once, at least one (null: all the model's)")
    if lora.sync == "adapter" and config.rollout.engine == "transformers":
        errors.append("lora.sync=adapter with rollout.engine=transformers: the engines load the adapter with vLLM's "
                      "LoRA; use rollout.engine=vllm, auto or fleet, or lora.sync=merged")
    if config.model.compile:
        errors.append("lora.rank >= 1 with model.compile=true: compiled layers are not tested with adapters; use "
                      "model.compile=false")
    return errors


def _sampling_errors(config: Config) -> list[str]:
    """Groups, sampling and DAPO's length shaping, the probe's tolerance."""
    errors, r = [], config.rollout
    if r.group_size < 2:
        errors.append(f"rollout.group_size={r.group_size}: group-relative advantages need G >= 2")
    if not 0 < r.top_p <= 1 or r.temperature <= 0:
        errors.append(f"rollout.temperature={r.temperature}, rollout.top_p={r.top_p}: "
                      "need temperature > 0, 0 < top_p <= 1")
    if 0 < r.top_p < 1:
        errors.append(f"rollout.top_p={r.top_p}: the trainer scores tokens under the whole softmax(logits / "
                      "temperature), so an unchanged policy's ratio to a nucleus-sampled token would be the nucleus's "
                      "mass, not 1, and the clip would act off-centre; use top_p=1 (temperature is applied on both "
                      "sides)")
    if not 0 <= r.overlong_buffer <= r.max_new_tokens:
        errors.append(f"rollout.overlong_buffer={r.overlong_buffer}: must be in [0, rollout.max_new_tokens="
                      f"{r.max_new_tokens}] (the last tokens before the limit where the length penalty grows)")
    if not r.overlong_penalty >= 0:
        errors.append(f"rollout.overlong_penalty={r.overlong_penalty}: must be >= 0 (the penalty at the length limit)")
    if r.oversample < 1:
        errors.append(f"rollout.oversample={r.oversample}: must be >= 1 (a refill round asks for "
                      "ceil(missing x oversample) prompts)")
    if r.verify_tolerance is not None and r.verify_tolerance < 0:
        errors.append(f"rollout.verify_tolerance={r.verify_tolerance}: must be >= 0 (or null: the precision's default)")
    return errors


def _rollout_mode_errors(config: Config) -> list[str]:
    """The engine, its transport and the rollout mode's keys, which only some combinations allow."""
    errors, r, m = [], config.rollout, config.model
    if r.sync == "delta" and r.engine == "transformers":
        errors.append("rollout.sync=delta with rollout.engine=transformers: deltas need vLLM (rollout.engine=vllm, "
                      "fleet or auto with vLLM installed)")
    if r.sync == "delta" and config.lora.rank and config.lora.sync == "adapter":
        errors.append("rollout.sync=delta with lora.sync=adapter: deltas are of whole weights (lora.sync=merged); an "
                      "adapter refresh is already small")
    if r.sync == "delta" and r.engine == "fleet" and r.dtype == "auto":
        errors.append("rollout.sync=delta with rollout.engine=fleet: set rollout.dtype to the fleet's --dtype (the "
                      "trainer keeps the image the deltas are measured against in that dtype)")
    if r.engine == "fleet" and not r.fleet_state:
        errors.append("rollout.engine='fleet' needs rollout.fleet_state (the --state-dir of `offgrpo fleet start`)")
    if r.transport in ("collective", "shm") and r.engine != "fleet":
        errors.append(f"rollout.transport={r.transport!r} needs rollout.engine='fleet' (got {r.engine!r})")
    errors.extend(_collective_host_errors(r.collective_host))
    # what is left of the four rules between mode, overlap, partial_rollouts, max_staleness and behavior_logprobs once
    # the first three are one choice (rollout.mode): the conflicts between independent keys
    if r.behavior_logprobs == "recompute" and r.mode != "lockstep":
        errors.append(f"rollout.behavior_logprobs='recompute' with rollout.mode={r.mode!r}: the snapshot holds the "
                      "weights last pushed, and this mode trains samples generated before them (overlap: a version "
                      "behind; async: up to max_staleness); use behavior_logprobs='fleet' or mode='lockstep'")
    if r.mode == "async_partial" and (r.engine == "transformers" or m.router_replay):
        errors.append(f"rollout.mode='async_partial' with rollout.engine={r.engine!r}, model.router_replay="
                      f"{m.router_replay}: partial rollouts need vLLM (engine=vllm, auto or fleet), without router "
                      "replay; or mode='async'")
    errors.extend(_staleness_errors(r))
    return errors


def _model_errors(config: Config) -> list[str]:
    """The model's source, compilation, MoE loss and the arithmetic task's size."""
    errors, m = [], config.model
    if m.compile and (config.parallel.tp > 1 or m.precision == "fp8"):
        errors.append(f"model.compile=true with parallel.tp={config.parallel.tp}, model.precision={m.precision!r}: "
                      "compiled layers are tested at tp=1 on the local spec (bf16/fp32); use tp=1 and no fp8, or "
                      "model.compile=false")
    if config.data.max_operand < (1 if config.data.name == "arithmetic" else 0):
        errors.append(f"data.max_operand={config.data.max_operand}: must be >= 1 (the arithmetic task holds a fifth of "
                      "its (max_operand + 1)^2 questions out for evaluation: one question cannot be split)")
    if config.model.moe_aux_loss_coef is not None and not config.model.moe_aux_loss_coef >= 0:
        errors.append(f"model.moe_aux_loss_coef={config.model.moe_aux_loss_coef}: must be >= 0 (0: no load-balancing "
                      "loss; null: the HF config's router_aux_loss_coef)")
    if not m.hf_path:
        errors.append("model.hf_path is empty: give a HF model directory or hub id (init=random and init=megatron "
                      "read its config and tokenizer)")
    if (m.init == "megatron") != bool(m.megatron_path):
        errors.append(f"model.init={m.init!r} with model.megatron_path={m.megatron_path!r}: init=megatron starts "
                      "from the megatron checkpoint at megatron_path, which only it reads; give both or neither")
    return errors


def _train_errors(config: Config) -> list[str]:
    """The warm-up, the objective's scalar bounds, trackers and the run's periods."""
    errors, a = [], config.algo
    if not 0 <= config.sft.off_by_one_fraction <= 1:
        errors.append(f"sft.off_by_one_fraction={config.sft.off_by_one_fraction}: must be in [0, 1]")
    if a.kl_beta < 0 or a.eps_low < 0 or a.eps_high < 0 or a.tau < 0:
        errors.append("algo.kl_beta, algo.eps_low, algo.eps_high, algo.tau must be >= 0")
    if a.dual_clip is not None and a.dual_clip <= 1:
        errors.append(f"algo.dual_clip={a.dual_clip}: must be > 1 (or null)")
    if a.tis_cap is not None and a.tis_cap <= 0:
        errors.append(f"algo.tis_cap={a.tis_cap}: must be > 0 (or null)")
    if len(set(config.train.loggers)) < len(config.train.loggers):
        errors.append(f"train.loggers={config.train.loggers}: each logger once")
    for key in ("train.save_every", "train.eval_every", "train.export_every", "train.samples_every"):
        if _get(config, key) < 0:
            errors.append(f"{key}={_get(config, key)}: must be >= 0 (0 = off)")
    return errors


MAX_STALENESS = 64
"""The largest async staleness bound (``rollout.max_staleness``, or ``refresh_every`` when it is null). Every step the
bound allows generates at once (on vLLM and the fleet): B + 1 steps' requests and threads, and their finished batches
held in memory and written into every checkpoint, so the bound is also a memory bound; and a sample 64 optimizer steps
old has a ratio the clipped objective mostly masks (async RL systems run at 1 to 8)."""


def _staleness_errors(r: RolloutConfig) -> list[str]:
    if r.max_staleness is not None and (not r.asynchronous() or r.max_staleness < r.refresh_every - 1):
        return [f"rollout.max_staleness={r.max_staleness} with rollout.mode={r.mode!r}, refresh_every="
                f"{r.refresh_every}: it bounds async generation (mode='async' or 'async_partial') and must be >= "
                "refresh_every - 1 (a smaller bound would wait for a version the trainer only pushes after that batch)"]
    if r.asynchronous() and r.staleness_bound() > MAX_STALENESS:
        key = ("rollout.max_staleness" if r.max_staleness is not None
               else "rollout.refresh_every (the bound when rollout.max_staleness is null)")
        return [f"{key}={r.staleness_bound()}: the async staleness bound must be <= {MAX_STALENESS}; every step it "
                "allows generates at once, its requests and finished batch held in memory and in each checkpoint "
                f"(and samples that stale barely move the clipped objective): use a bound <= {MAX_STALENESS}"]
    return []


def _distill_errors(d: DistillConfig, temperature: float) -> list[str]:
    """The teacher's place (at most one) and the distillation's weights and discount: each broken rule on its own line,
    with the values given; without a teacher, any other ``distill.*`` key set (it would be ignored)."""
    given = [key for key in ("teacher_path", "teacher_fleet") if getattr(d, key) is not None]
    if not given:
        return _teacherless_errors(d)
    if len(given) > 1:
        return [f"distill.teacher_path={d.teacher_path!r}, distill.teacher_fleet={d.teacher_fleet!r}: give one teacher "
                "(on the trainer's ranks, or served by its own fleet)"]
    errors, teacher = [], getattr(d, given[0])
    if not teacher.strip():
        errors.append(f"distill.{given[0]}={teacher!r}: empty; give the teacher (a HF model directory, or the state "
                      "directory of its fleet), or null for no distillation")
    errors += [f"distill.{key}={getattr(d, key)}: must be >= 0" for key in ("weight", "reward_weight")
               if getattr(d, key) < 0]
    if d.weight == 0 and d.reward_weight == 0:
        errors.append(f"distill.weight={d.weight}, distill.reward_weight={d.reward_weight}: both 0 leaves every "
                      "advantage 0 (nothing trains); give the teacher's (weight) or the reward's (reward_weight) a "
                      "weight > 0")
    if not 0 <= d.discount <= 1:
        errors.append(f"distill.discount={d.discount}: must be in [0, 1]")
    if d.teacher_fleet is not None and temperature != 1.0:
        errors.append(f"distill.teacher_fleet with rollout.temperature={temperature}: a fleet scores the teacher at "
                      "temperature 1 (prompt log-probs of the raw logits), the student samples at another: set "
                      "rollout.temperature=1, or put the teacher on the trainer's ranks (distill.teacher_path)")
    return errors


def _teacherless_errors(d: DistillConfig) -> list[str]:
    """A ``distill.*`` setting away from its default without a teacher: the run would ignore it. (The config keeps no
    record of which keys were given: a key given at its default value changes nothing and passes.)"""
    return [f"distill.{f.name}={getattr(d, f.name)} without a teacher: it sets how the run distills, which needs "
            "distill.teacher_path (or distill.teacher_fleet); give the teacher, or drop the key"
            for f in dataclasses.fields(d)
            if f.name not in ("teacher_path", "teacher_fleet") and getattr(d, f.name) != _default(f)]


def _reward_errors(r: RewardConfig, env_name: str | None) -> list[str]:
    """The reward model's place (one of model and judge), its weights and bounds; without one, any other
    ``reward.*`` key set (it would be ignored), as the judge's keys with a scalar model."""
    if not r.on:
        return [f"reward.{f.name}={getattr(r, f.name)} without reward.model or reward.judge: it sets how a model "
                "scores the completions; give the model, or drop the key"
                for f in dataclasses.fields(r) if getattr(r, f.name) != _default(f)]
    if r.model and r.judge:
        return [f"reward.model={r.model!r}, reward.judge={r.judge!r}: give one (a scalar reward model, or a "
                "generative judge)"]
    errors = []
    if r.model:
        errors += [f"reward.{f.name}={getattr(r, f.name)} with a scalar reward model (reward.model): it sets how a "
                   "judge replies; drop the key, or give reward.judge instead"
                   for f in dataclasses.fields(r) if f.name.startswith("judge_") or f.name == "unparsed"
                   if getattr(r, f.name) != _default(f)]
    errors += [f"reward.{key}={getattr(r, key)}: must be >= 0" for key in ("rule_weight", "model_weight",
                                                                           "judge_temperature")
               if getattr(r, key) < 0]
    if r.rule_weight == 0 and r.model_weight == 0:
        errors.append("reward.rule_weight=0, reward.model_weight=0: every reward would be 0 (nothing trains); give "
                      "either a weight > 0")
    errors += [f"reward.{key}={getattr(r, key)}: must be >= 1" for key in ("judge_max_tokens", "judge_attempts")
               if getattr(r, key) < 1]
    errors += [f"reward.{key}={getattr(r, key)}: must be > 0" for key in ("timeout_s", "clip")
               if getattr(r, key) is not None and not getattr(r, key) > 0]
    if env_name:
        errors.append(f"reward.{'model' if r.model else 'judge'} with env.name={env_name!r}: models score "
                      "single-turn completions; an episode is rewarded by its environment (score inside it)")
    return errors


def _default(field: dataclasses.Field) -> object:
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _env_errors(env: EnvConfig) -> list[str]:
    """Multi-turn episodes' limits and environment name (imported here, so ``offgrpo config`` refuses what ``train``
    would: ``envs.environment_name_error``, which runs none of the user's code), and keys set for nothing."""
    errors = []
    if env.max_turns < 1 or (env.max_tokens is not None and env.max_tokens < 1):
        errors.append(f"env.max_turns={env.max_turns}, env.max_tokens={env.max_tokens}: must be >= 1")
    if min(env.tool_cpu_s, env.tool_wall_s) <= 0 or min(env.tool_memory_mib, env.tool_output_bytes) < 1:
        errors.append("env.tool_cpu_s, env.tool_wall_s, env.tool_memory_mib, env.tool_output_bytes: must be > 0")
    if env.step_timeout_s <= 0:
        errors.append(f"env.step_timeout_s={env.step_timeout_s}: must be > 0 (seconds one call of the environment "
                      "may take)")
    if env.name is not None and not env.name.strip():
        errors.append("env.name is empty: null for single-turn, or an environment's name")
    elif env.name is not None:
        from megatron_offgrpo.envs import environment_name_error  # stdlib and data only: no cycle back to config

        errors.extend([error] if (error := environment_name_error(env.name)) else [])
    return errors + _idle_env_keys(env)


def _idle_env_keys(env: EnvConfig) -> list[str]:
    """env.* keys changed from their defaults that do nothing: every one without env.name (single-turn), the
    sandbox's (tool_*) with an environment other than python_tool. Silently ignored, a typo'd recipe would train
    something else than its author meant."""
    defaults = type(env)()
    changed = [f.name for f in dataclasses.fields(env)
               if f.name != "name" and getattr(env, f.name) != getattr(defaults, f.name)]
    if env.name is None:
        return [f"env.{key}={getattr(env, key)} does nothing without env.name (single-turn completions): set "
                "env.name for multi-turn episodes, or drop the key" for key in changed]
    if env.name != "python_tool":
        return [f"env.{key}={getattr(env, key)} applies to env.name=python_tool only (its sandbox), not "
                f"env.name={env.name!r}: drop the key" for key in changed if key.startswith("tool_")]
    return []


def _choice_errors(config: Config) -> list[str]:
    """Every choice key (a ``Literal`` field; in a list, each item) holding a value outside its choices."""
    errors = []
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for name, hint in field_types(type(values)).items():
            allowed, value = choices(hint), getattr(values, name)
            if allowed is None or value is None:
                continue
            if isinstance(value, list):
                unknown = [item for item in value if item not in allowed]
                if unknown:
                    errors.append(f"{section.name}.{name}={value}: unknown {unknown}; valid: {list(allowed)}")
            elif value not in allowed:
                errors.append(f"{section.name}.{name}={value!r}: expected one of {list(allowed)}")
    return errors


def _nonfinite_errors(config: Config) -> list[str]:
    errors = []
    for section in dataclasses.fields(config):
        for field in dataclasses.fields(getattr(config, section.name)):
            value = getattr(getattr(config, section.name), field.name)
            if isinstance(value, float) and not math.isfinite(value):
                errors.append(f"{section.name}.{field.name}={value}: must be a finite number")
    return errors


def _optim_errors(config: Config) -> list[str]:
    o = config.optim
    errors = []
    if o.lr <= 0:
        errors.append(f"optim.lr={o.lr}: must be > 0")
    if not 0 <= o.min_lr <= max(o.lr, 0):
        errors.append(f"optim.min_lr={o.min_lr}: must be in [0, optim.lr={o.lr}] (the cosine schedule decays to it)")
    if o.warmup_steps < 0:  # a warm-up longer than the run is fine: a short trial run of a long recipe
        errors.append(f"optim.warmup_steps={o.warmup_steps}: must be >= 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, key) < 1:
            errors.append(f"optim.{key}={getattr(o, key)}: must be in [0, 1)")
    for key in ("weight_decay", "clip_grad"):
        if getattr(o, key) < 0:
            errors.append(f"optim.{key}={getattr(o, key)}: must be >= 0 (0: off)")
    if o.shared_prompt and not o.packing:
        errors.append("optim.shared_prompt=true needs optim.packing=true (a group's prompt and its branches share a "
                      "packed row): set optim.packing=true or optim.shared_prompt=false")
    return errors


def _collective_host_errors(host: str | None) -> list[str]:
    """``rollout.collective_host``: an address the fleet's workers can dial (like ``fleet_state``, it is simply unused
    by the other transports, so a launcher may always pass rank 0's node)."""
    if host is None:
        return []
    key = f"rollout.collective_host={host!r}"
    if not host or any(c.isspace() for c in host):
        return [f"{key}: give rank 0's host name or IP, without spaces (or null for 127.0.0.1)"]
    if "/" in host:
        return [f"{key}: give a bare host name or IP, not a URL or path"]
    if host in WILDCARDS:
        return [f"{key} is a bind-all address, which the fleet's workers cannot dial: give rank 0's host name "
                "or IP as the fleet nodes see it"]
    name, sep, port = host.rpartition(":")
    if sep and port.isdigit() and ":" not in name:  # "node0:29600" (an IPv6 address has several colons)
        return [f"{key}: give the host only ({name!r}); the trainer picks a free rendezvous port"]
    return []


def _algo_errors(config: Config) -> list[str]:
    """Let ``algo``'s own parameter validation speak (it knows which switches combine)."""
    constant = config.rollout.drgrpo_constant()  # the trainer's value (train._trainer_side)
    out = []
    for build in (lambda: config.algo.objective_params(constant), config.algo.advantage_params):
        try:
            build()  # the algo dataclasses validate in __post_init__
        except (ValueError, TypeError) as exc:
            out.append(f"algo: {exc}")
    return out


def _path_errors(config: Config) -> list[str]:
    """A path key with a component no filesystem takes: named now, not an ``OSError`` traceback where it is read."""
    errors = []
    for key in PATHS:
        value = _get(config, key)
        if value and (long := long_component(value)) is not None:
            errors.append(f"{key}={value}: {long}: choose a shorter {key}")
    return errors


def _parallel_errors(p: ParallelConfig) -> list[str]:
    """``parallel.etp`` and ``parallel.sequence_parallel`` against tp (what megatron would refuse later, named now)."""
    errors = []
    if p.etp is not None and p.etp < 1:
        errors.append(f"parallel.etp={p.etp}: must be >= 1 (or null: parallel.tp)")
    if p.sequence_parallel and p.tp < 2:
        errors.append(f"parallel.sequence_parallel=true needs parallel.tp > 1 (tp={p.tp}): sequence parallelism splits "
                      "each row's positions over the TP ranks; set tp >= 2 or sequence_parallel=null")
    return errors
