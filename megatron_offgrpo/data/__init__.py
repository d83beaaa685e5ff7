"""Data: prompt/sample types, prompt datasets, chat templates and verifiable rewards."""

from megatron_offgrpo.data._datasets import ASSETS, QARecord, arithmetic_records, load_hub, load_local, load_records
from megatron_offgrpo.data._heldout import held_out_questions, question_key
from megatron_offgrpo.data._prompts import PromptStream, build_prompt
from megatron_offgrpo.data._rewards import (
    MAX_ANSWER_DIGITS,
    answer_error,
    extract_answer,
    get_reward,
    import_dotted,
    math_exact_reward,
    math_strict_reward,
    normalize_number,
    register_reward,
)
from megatron_offgrpo.data._sets import DataSets, load_datasets
from megatron_offgrpo.data._turns import PLAIN, TurnWrapping, observation_ids, turn_wrapping
from megatron_offgrpo.data._types import Prompt, Sample, SamplingParams

__all__ = [
    "ASSETS",
    "MAX_ANSWER_DIGITS",
    "PLAIN",
    "DataSets",
    "Prompt",
    "PromptStream",
    "QARecord",
    "Sample",
    "SamplingParams",
    "TurnWrapping",
    "answer_error",
    "arithmetic_records",
    "build_prompt",
    "extract_answer",
    "get_reward",
    "held_out_questions",
    "question_key",
    "import_dotted",
    "load_datasets",
    "load_hub",
    "load_local",
    "load_records",
    "math_exact_reward",
    "math_strict_reward",
    "normalize_number",
    "observation_ids",
    "register_reward",
    "turn_wrapping",
]
