"""Every check that can run before a process group, a model or an engine exists: the recipe, the overrides, what
they ask of the model (its config read from ``model.hf_path``), and the data (every row the run will read). A command
that fails here prints one line per error and exits 2, having written nothing."""

from __future__ import annotations

import math
import os
import shlex
import sys
from pathlib import Path

from megatron_offgrpo.config import Config, ConfigError, TrainConfig, load_config, long_component
from megatron_offgrpo.model import QwenArch, load_arch, lora, resolve_model_dir, tokenizer_errors
from megatron_offgrpo.runlog import missing_trackers


def model_dir_errors(source: str | Path, key: str, weights: bool = True, tokenizer: bool = False) -> list[str]:
    """What keeps the HF model directory ``source`` (``key`` names where it came from: ``model.hf_path``,
    ``--model``) from being trained, evaluated or served: its config (a supported architecture, every size >= 1);
    with ``weights``, its safetensors (present, not cut short, every tensor of the config's shape: headers only, no
    tensor is loaded); with ``tokenizer``, its own tokenizer (it must load and encode a probe to some tokens). The
    one check of ``train``, ``sft``, ``eval`` and ``fleet start``."""
    if (long := long_component(source)) is not None:  # before any stat(): it would raise
        return [f"{key}={source}: {long}: choose a shorter {key}"]
    try:
        arch = load_arch(source)
    except (OSError, ValueError) as exc:  # OSError: a path over the system's length limit, a directory not readable
        return [f"{key}={source}: {getattr(exc, 'strerror', None) or exc}"]
    model_dir = resolve_model_dir(source)
    errors = []
    if weights:
        from checkpoint_tools import checks  # imports torch (about 1 s): only when weights are read

        errors += [f"{key}={source}: {error}" for error in checks.hf_dir_errors(model_dir, arch)]
    if tokenizer:
        errors += tokenizer_errors(model_dir, key, source)
    return errors


def length_errors(config: Config, max_positions: int, source: str | Path) -> list[str]:
    """``rollout.max_new_tokens`` must leave room for a prompt in the model's positions: refused, not silently capped.
    (The prompts themselves are known once tokenized: ``prompt_length_error`` checks the longest against the same
    bound before any engine starts.)"""
    r = config.rollout
    if r.max_new_tokens < max_positions:
        return []
    return [f"rollout.max_new_tokens={r.max_new_tokens}: a prompt and its completion must fit the model's "
            f"max_position_embeddings={max_positions} ({source}): lower rollout.max_new_tokens to at most "
            f"{max_positions} minus the longest prompt's tokens"]


def resume_errors(config: Config) -> list[str]:
    """A resume (``train.resume``) of a checkpoint whose model has other shapes than ``model.hf_path``'s: one line
    naming both shapes, from the checkpoint's model card, before megatron's loader fails deep inside (or, for a
    reshaped dimension it can slice, succeeds wrongly)."""
    from megatron_offgrpo.runlog import checkpoints

    checkpoint = checkpoints.latest_checkpoint(config.train.out_dir) if config.train.resume else None
    if checkpoint is None:
        return []
    from checkpoint_tools import checks

    return (_card_shape_errors(config, checkpoint, "--resume", "resume with the model the run started from, or start "
                               "a new train.out_dir")
            or [f"--resume: {error}" for error in checks.dist_dir_errors(checkpoint)])


def megatron_init_errors(config: Config) -> list[str]:
    """``model.init=megatron``: ``model.megatron_path`` is a whole dist checkpoint (every file its metadata names,
    none cut short: ``offgrpo convert megatron-to-hf``'s check) of ``model.hf_path``'s shapes."""
    from checkpoint_tools import CheckpointError, checks, dist_ckpt

    if config.model.init != "megatron":
        return []
    key = f"model.megatron_path={config.model.megatron_path}"
    try:
        if dist_ckpt.checkpoint_kind(config.model.megatron_path) != "dist":
            return [f"{key}: a checkpoint_tools directory of an earlier version, which init=megatron does not read: "
                    "convert the HF model again (offgrpo convert hf-to-megatron) to a dist checkpoint"]
        checkpoint = dist_ckpt.resolve_checkpoint(config.model.megatron_path)
    except CheckpointError as exc:
        return [f"{key}: {exc}"]
    return (_card_shape_errors(config, checkpoint, key, "give the model.hf_path it was converted from")
            or [f"{key}: {error}" for error in checks.dist_dir_errors(checkpoint)])


def _card_shape_errors(config: Config, checkpoint: Path, key: str, fix: str) -> list[str]:
    """The first tensor whose shape in ``checkpoint``'s model card differs from ``model.hf_path``'s model."""
    from checkpoint_tools import CheckpointError, dist_ckpt, hf_shapes

    from megatron_offgrpo.model import arch_from_hf_config

    try:
        saved = hf_shapes(arch_from_hf_config(dist_ckpt.read_model_card(checkpoint).hf_config))
    except (CheckpointError, ValueError) as exc:
        return [f"{key}: {checkpoint}: {exc}"]
    ours = hf_shapes(load_arch(config.model.hf_path))
    for name in [n for n in saved if n in ours and saved[n] != ours[n]] + sorted(set(saved) ^ set(ours)):
        theirs, mine = (list(saved[name]) if name in saved else "absent"), (list(ours[name]) if name in ours else
                                                                              "absent")
        return [f"{key}: {checkpoint} holds {name} of shape {theirs}, model.hf_path={config.model.hf_path} "
                f"gives {mine}: {fix}"]
    return []


def model_errors(config: Config, model_dir: str | None = None) -> list[str]:
    """What the model at ``model_dir`` (default ``model.hf_path``) cannot do under ``config``: be read (its config,
    weights when ``model.init=hf``, tokenizer), be split, fit the run's sequence length; ``model.init=megatron``: its
    checkpoint (``megatron_init_errors``)."""
    source = model_dir or config.model.hf_path
    key = "--model" if model_dir else "model.hf_path"
    errors = model_dir_errors(source, key, weights=bool(model_dir) or config.model.init == "hf", tokenizer=True)
    if errors:
        return errors
    arch = load_arch(source)
    length = length_errors(config, arch.max_position_embeddings, source)
    if length:
        return length
    checkpoint = [] if model_dir else resume_errors(config) + megatron_init_errors(config)
    if checkpoint:
        return checkpoint
    p = config.parallel
    try:
        arch.check_layout(p.tp, p.pp, p.ep, p.etp)
    except ValueError as exc:
        ep = f", parallel.ep={p.ep}" if p.ep > 1 else ""
        etp = f", parallel.etp={p.etp}" if p.etp is not None else ""
        return [f"parallel.tp={p.tp}, parallel.pp={p.pp}{ep}{etp}: {line.strip()}"
                for line in str(exc).splitlines()[1:]]
    if arch.is_moe and p.tp > 1 and p.sequence_parallel is False:
        return [f"parallel.sequence_parallel=false with parallel.tp={p.tp}: megatron trains mixture-of-experts layers "
                "with tp > 1 only under sequence parallelism (every TP rank would route the same tokens): set "
                "parallel.sequence_parallel=null (or true), or parallel.tp=1"]
    if config.model.router_replay and not arch.is_moe:
        return [f"model.router_replay=true: {source} is a dense {arch.model_type} model, with no routers to replay"]
    try:
        lora.lora_spec(arch, config.lora.rank, config.lora.alpha, config.lora.dropout, config.lora.targets, 0)
    except ValueError as exc:
        return [str(exc)]
    if model_dir:  # fleet start: the policy's server, no teacher or reward model to check
        return []
    teacher, errors = config.distill.teacher_path, []
    if teacher:
        errors = model_dir_errors(teacher, "distill.teacher_path", tokenizer=True)
        errors = errors or teacher_errors(load_arch(teacher), arch, p.tp, p.pp, p.ep, p.etp)
        errors = errors or tokenizer_errors(resolve_model_dir(teacher), "distill.teacher_path", teacher, policy=source)
    if config.distill.teacher_fleet:
        errors = teacher_fleet_errors(config.distill.teacher_fleet, arch, source)
    return errors or reward_model_errors(config, source)


def reward_model_errors(config: Config, policy: str | Path) -> list[str]:
    """Why ``reward.model`` or ``reward.judge`` cannot score: a directory that does not resolve, a model of the wrong
    kind (a classifier with one label; a causal LM for a judge), a classifier whose tokenizer numbers the policy's
    tokens otherwise (it reads the policy's token ids), a judge whose tokenizer does not load, or a ``reward.fleet``
    not recorded or serving another directory."""
    import json

    r = config.reward
    if not r.on:
        return []
    key, source = ("reward.judge", r.judge) if r.judge else ("reward.model", r.model)
    try:
        directory = resolve_model_dir(source)
    except FileNotFoundError as exc:
        return [f"{key}={source}: {exc}"]
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return [f"{key}={source}: no readable config.json ({getattr(exc, 'strerror', None) or exc})"]
    architectures = hf.get("architectures") or ["?"]
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if r.model and not (architectures[0].endswith("ForSequenceClassification") and labels == 1):
        kind = f"{architectures[0]} with {labels} labels" if "Classification" in architectures[0] else architectures[0]
        return [f"reward.model={source}: a {kind}; a scalar reward model is a "
                "sequence classifier with one label (its logit is the reward), e.g. Qwen2ForSequenceClassification"]
    if r.judge and not architectures[0].endswith("ForCausalLM"):
        return [f"reward.judge={source}: a {architectures[0]}; a judge is a causal LM that replies (for a "
                "classifier, use reward.model)"]
    if r.judge:
        from megatron_offgrpo.reward import JudgeTemplate, TemplateError

        try:
            JudgeTemplate.load(r.judge_template)
        except TemplateError as exc:
            return [str(exc)]
    errors = tokenizer_errors(directory, key, source, policy=policy if r.model else None)
    if errors or not r.fleet:
        return errors
    from megatron_offgrpo.fleet import load_state

    try:
        served = Path(load_state(r.fleet).model_dir)
    except (OSError, ValueError) as exc:
        return [f"reward.fleet={r.fleet}: {exc}"]
    if served.exists() and served.resolve() != directory.resolve():
        return [f"reward.fleet={r.fleet} serves {served}, not {key}={source}: give the directory the fleet serves "
                "(the trainer reads its tokenizer), or the fleet that serves it"]
    return []


def teacher_fleet_errors(state: str, student: QwenArch, policy: str | Path) -> list[str]:
    """Why the teacher's fleet cannot score the student's tokens: no fleet recorded there, or a served model whose
    vocabulary is smaller or whose tokenizer numbers the policy's tokens otherwise. What is compared is the model
    directory the fleet's state records, where it is visible from here; not checked: a fleet serving from other
    nodes' disks (nothing to read here), and a server restarted on another model since the state was written (the
    servers themselves load no tokenizer to ask: ``--skip-tokenizer-init`` where the directory has none)."""
    from megatron_offgrpo.fleet import load_state

    try:
        served = load_state(state).model_dir
    except (OSError, ValueError) as exc:
        return [f"distill.teacher_fleet={state}: {exc}"]
    if not (Path(served) / "config.json").is_file():  # a fleet serving from other nodes' disks: nothing to read here
        return []
    return (_vocabulary_errors(f"distill.teacher_fleet={state} (serving {served})", load_arch(served), student)
            or tokenizer_errors(Path(served), "distill.teacher_fleet", f"{state} (serving {served})", policy=policy))


def _vocabulary_errors(key: str, teacher: QwenArch, student: QwenArch) -> list[str]:
    """A teacher whose vocabulary does not cover the student's (wherever it runs)."""
    if teacher.vocab_size >= student.vocab_size:
        return []
    return [f"{key}: its vocabulary ({teacher.vocab_size}) is smaller than the student's ({student.vocab_size}): it "
            "must score every token the student samples (the same tokenizer family)"]


def teacher_errors(teacher: QwenArch, student: QwenArch, tp: int, pp: int, ep: int, etp: int | None) -> list[str]:
    """Why the distillation teacher cannot score the student's tokens at this layout (empty when it can)."""
    errors = _vocabulary_errors("distill.teacher_path", teacher, student)
    try:
        teacher.check_layout(tp, pp, ep, etp)
    except ValueError as exc:
        errors += [f"distill.teacher_path at parallel.tp={tp}, parallel.pp={pp}: {line.strip()} (the teacher runs at "
                   "the student's layout)" for line in str(exc).splitlines()[1:]]
    return errors


def layout_errors(config: Config) -> list[str]:
    """What the attention path cannot do. Megatron's TE spec builds its attention with the causal mask type, for which
    TE ignores a given attention mask: packed rows would attend across their sequences, silently. TE takes a dense
    mask only as ``arbitrary`` (its unfused path) and its THD path only block-diagonal ``cu_seqlens`` (packing's GPU
    half, not built), never a shared prompt's tree mask (train._shared_prompt)."""
    o = config.optim
    if not (o.packing or o.shared_prompt):
        return []
    from megatron_offgrpo.runtime import have_te  # imports torch (about 1 s): only when it can matter

    if have_te():
        keys = "optim.packing=true" + (" and optim.shared_prompt=true" if o.shared_prompt else "")
        return [f"{keys} need the local layer spec, but Transformer Engine is in use (its causal attention ignores "
                "the packed rows' mask): set optim.packing=false"]
    return []


def world_errors(config: Config, relaunch: list[str]) -> list[str]:
    """The parallel layout against the processes this job has (torchrun's ``WORLD_SIZE``; 1 without torchrun): TP x PP
    must divide them and the experts' ETP x EP the processes of a stage, or megatron's set-up refuses after the run
    directory and its log exist. The one line gives the torchrun command of the smallest job that fits:
    ``relaunch`` is ``-m MODULE ARGS...`` of this command."""
    p = config.parallel
    etp = p.tp if p.etp is None else p.etp
    need = p.pp * math.lcm(p.tp, etp * p.ep)  # world % (tp * pp) == 0 and (world / pp) % (etp * ep) == 0
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(raw)
    except ValueError:
        return [f"WORLD_SIZE={raw!r}: not a process count (torchrun sets it; unset it for one process)"]
    if world >= 1 and world % need == 0:
        return []
    ep = f" x parallel.ep={p.ep}" + (f" (parallel.etp={etp})" if p.etp is not None else "") if p.ep > 1 else ""
    has = "one process (no torchrun)" if "WORLD_SIZE" not in os.environ else f"{world} processes"
    return [f"parallel.tp={p.tp} x parallel.pp={p.pp}{ep} needs a multiple of {need} processes, this job has {has}: "
            f"launch it as `torchrun --nproc_per_node={need} {shlex.join(relaunch)}`, or lower the parallel sizes"]


def tracker_errors(config: Config) -> list[str]:
    """The trackers of ``train.loggers`` that are not installed, except the default list's tensorboard (skipped with
    an INFO line at start): a tracker the user named is never skipped silently."""
    if config.train.loggers == TrainConfig().loggers:
        return []
    return missing_trackers(config.train.loggers)


MATH_REWARDS = ("math_exact", "math_strict")  # the rewards that read a number from the ground truth


def data_errors(config: Config, model_dir: str | None = None) -> list[str]:
    """What is wrong with the recipe's data, each naming the file and line (or row): the files cannot be read (cut
    short, binary, empty, a directory), a row lacks a key, a ground truth the math rewards cannot score (no number, not
    finite, over ``MAX_ANSWER_DIGITS`` digits), a prompt over ``data.max_prompt_tokens`` (the model's tokenizer, read
    once: ``model_dir``'s, default ``model.hf_path``'s). Every training record and the evaluation records a run uses
    are checked: later, each of these is a traceback (or a reward of 0 for a wrong reason) steps into the run."""
    from megatron_offgrpo.data import rewards
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.sampler import build_prompts, load_data, used_records

    try:
        data = load_data(config)
    except (ValueError, FileNotFoundError) as exc:
        return [str(exc)]
    except OSError as exc:  # a file not readable, a path over the system's length limit: name the key
        d = config.data
        key = next((k for k, v in (("data.eval_path", d.eval_path), ("data.path", d.path)) if v and exc.filename
                    and Path(v).name == Path(exc.filename).name), "data.path")
        return [f"{key}={exc.filename}: {exc.strerror}"]
    records = used_records(config, data, "train") + used_records(config, data, "eval")
    if config.data.reward in MATH_REWARDS:
        for record in records:
            problem = rewards.answer_error(record.answer)
            if problem is not None:
                return [f"{record.where}: {problem}: fix or remove the row (data.reward={config.data.reward} compares "
                        "numbers)"]
    tokenizer = load_tokenizer(model_dir or config.model.hf_path)
    if config.data.prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
        return [f"data.prompt_format=chat: the tokenizer of {model_dir or config.model.hf_path} has no chat_template: "
                "use a chat/instruct tokenizer (e.g. Qwen2.5's) or data.prompt_format=plain"]
    try:
        build_prompts(config, tokenizer, records)  # the run reuses the ids (``sampler._prompts.prompt_ids``)
    except ValueError as exc:
        return [str(exc)]
    return []


def environment_errors(config: Config) -> list[str]:
    """A custom ``env.name``'s factory, made and closed once: what it makes can only be told by calling it, and a
    refusal must come before the run directory is written (the config's validation checked the name itself)."""
    from megatron_offgrpo.data import rewards
    from megatron_offgrpo.envs import SHIPPED, EnvironmentContractError, EnvironmentTimeout
    from megatron_offgrpo.sampler import env_factory

    if not config.env.name or config.env.name in SHIPPED:
        return []
    try:
        reward_fn = rewards.get_reward(config.data.reward)
    except ValueError as exc:
        return [str(exc)]
    try:  # the name was checked by the config's validation; the factory's own exceptions keep their traceback
        env_factory(config, reward_fn)
    except (EnvironmentContractError, EnvironmentTimeout) as exc:
        return [str(exc)]
    return []


def config_or_exit(recipe: str | None, overrides: list[str], model_dir: str | None = None,
                   tracking: bool = False, relaunch: list[str] | None = None) -> Config:
    """The validated config of a command line, or (bad recipe, key, value or model; with ``tracking``, a tracker of
    ``train.loggers`` that is not installed; with ``relaunch`` (``-m MODULE ARGS...``: a command that builds the
    megatron model), a layout this job's process count cannot hold; a custom environment that makes none:
    ``environment_errors``; then bad data: ``data_errors``) its errors on stderr and exit 2."""
    try:
        config = load_config(recipe, overrides)
        errors = model_errors(config, model_dir) + layout_errors(config) + (tracker_errors(config) if tracking else [])
        errors += world_errors(config, relaunch) if relaunch is not None else []
        if errors:
            raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    errors = environment_errors(config) or data_errors(config, model_dir)  # outside the try: the user's exceptions
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if errors:
        sys.exit(2)
    return config
