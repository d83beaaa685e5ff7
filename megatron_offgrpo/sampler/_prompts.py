"""The run's tokenizer and prompts, as the engine sees them (the training stream, the eval set, ``offgrpo eval``)."""

from __future__ import annotations

import logging
import weakref

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import DataSets, Prompt, QARecord, build_prompt, load_datasets
from megatron_offgrpo.envs import environment_tools

logger = logging.getLogger(__name__)
ROLES = ("train", "eval")


# tokenizer -> {(system prompt, instruction, format, question): prompt ids}: each distinct question is tokenised
# once per process, whether the data check or the run asks first (GSM8K's 7473 chat prompts take seconds)
_PROMPT_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def load_data(config: Config) -> DataSets:
    """The recipe's training and evaluation records (``data.load_datasets``: held out by construction)."""
    d = config.data
    return load_datasets(d.name, d.split, d.eval_split, d.source, d.path, d.eval_path, question_key=d.question_key,
                         answer_key=d.answer_key, count=d.count, seed=config.parallel.seed, max_operand=d.max_operand)


def used_records(config: Config, data: DataSets, role: str) -> list[QARecord]:
    """The records a run uses in ``role``: every training record, or the first ``train.eval_prompts`` of the
    evaluation set."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}: expected one of {list(ROLES)}")
    return data.train if role == "train" else data.eval[: config.train.eval_prompts]


def prompt_ids(config: Config, tokenizer, record: QARecord, tools: list[dict] | None) -> tuple[int, ...]:
    """The token ids of ``record``'s prompt (chat template or plain text, announcing ``tools``), whatever their
    length; cached."""
    d = config.data
    cache = _PROMPT_IDS.setdefault(tokenizer, {})
    key = (d.system_prompt, d.instruction, d.prompt_format, repr(tools), record.question)
    if key not in cache:
        cache[key] = build_prompt(record, tokenizer, d.system_prompt, d.instruction, None, d.prompt_format,
                                  tools).prompt_ids
    return cache[key]


def build_prompts(config: Config, tokenizer, records: list[QARecord]) -> list[Prompt]:
    """``records`` built as the engine sees them (chat template or plain text).

    Raises:
        ValueError: a prompt longer than ``data.max_prompt_tokens``, naming its row.
    """
    prompts = []
    # the environment's tools (env.name), which the chat template lists in the system turn: found once per build
    tools = [t.as_template_tool() for t in environment_tools(config.env.name)] if config.env.name else None
    for record in records:
        ids = prompt_ids(config, tokenizer, record, tools)
        if len(ids) > config.data.max_prompt_tokens:
            raise ValueError(f"{record.where or record.record_id}: the prompt has {len(ids)} tokens > "
                             f"data.max_prompt_tokens={config.data.max_prompt_tokens}: shorten or remove the row, or "
                             "raise data.max_prompt_tokens")
        prompts.append(Prompt(record.record_id, ids, record.question, record.answer, record.max_new_tokens))
    return prompts


def prompt_length_error(prompts, config: Config, max_positions: int, split: str) -> str | None:
    """The longest prompt of ``split`` plus the longest response (``rollout.max_new_tokens``, or a multi-turn
    episode's ``env.max_tokens``) over the model's positions (the engine would cap it short silently), or None."""
    longest = max((len(p.prompt_ids) for p in prompts), default=0)
    env = config.env
    key, new = (("env.max_tokens", env.episode_tokens(config.rollout.max_new_tokens)) if env.name
                else ("rollout.max_new_tokens", config.rollout.max_new_tokens))
    if longest + new <= max_positions:
        return None
    return (f"{key}={new}: the longest prompt of data split {split!r} has {longest} tokens, so a "
            f"sequence reaches {longest + new}, over the model's max_position_embeddings={max_positions}: lower "
            f"{key} to <= {max(max_positions - longest, 0)} (or data.max_prompt_tokens)")


def load_prompts(config: Config, tokenizer, role: str) -> list[Prompt]:
    """The prompts of ``role`` ("train": the training stream's; "eval": the first ``train.eval_prompts`` of the
    evaluation set) of the recipe's dataset."""
    return build_prompts(config, tokenizer, used_records(config, load_data(config), role))


def log_data(config: Config, data: DataSets) -> dict[str, int | str]:
    """One start line with both set sizes and where evaluation reads from, one warning line when evaluation shares
    questions with training; returns the report (``run_info.json``'s ``data``)."""
    report = data.report(config.train.eval_prompts)
    logger.info("data: %d training prompts (%d distinct questions); evaluation on %d prompts (%d questions) from %s",
                report["train_size"], report["train_questions"], report["eval_size"], report["eval_questions"],
                report["eval_source"])
    if report["eval_overlap"]:
        logger.warning("data: %d of the %d evaluation prompts ask a question the run trains on: their accuracy is "
                       "not held-out accuracy (set data.eval_split or data.eval_path to other questions)",
                       report["eval_overlap"], report["eval_size"])
    return report
