"""Data: prompt/sample types, prompt datasets, chat templates and verifiable rewards."""

from megatron_offgrpo.data._datasets import ASSETS, QARecord, arithmetic_records, load_hub, load_local, load_records
from megatron_offgrpo.data._prompts import DEFAULT_INSTRUCTION, PromptStream, build_prompt
from megatron_offgrpo.data._rewards import (
    extract_answer,
    get_reward,
    math_exact_reward,
    math_strict_reward,
    normalize_number,
    register_reward,
)
from megatron_offgrpo.data._types import Prompt, Sample, SamplingParams

__all__ = [
    "ASSETS",
    "DEFAULT_INSTRUCTION",
    "Prompt",
    "PromptStream",
    "QARecord",
    "Sample",
    "SamplingParams",
    "arithmetic_records",
    "build_prompt",
    "extract_answer",
    "get_reward",
    "load_hub",
    "load_local",
    "load_records",
    "math_exact_reward",
    "math_strict_reward",
    "normalize_number",
    "register_reward",
]
