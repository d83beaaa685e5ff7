"""Data: prompt/sample types, prompt datasets, chat templates and verifiable rewards.

The types (``Prompt``, ``SamplingParams``, ``Sample``), the run's data sets (``load_datasets`` -> ``DataSets``) and
the prompt stream are on the door; three sets come whole under one name each: ``records`` (question/answer records
from the hub, local files or the built-in arithmetic task: ``records.load_local(...)``), ``rewards`` (the reward
registry and the math rewards' answer parsing: ``rewards.get_reward(name)``) and ``chat`` (how the chat template wraps
an observation's turn: ``chat.turn_wrapping(tokenizer, role)``, ``chat.observation_ids``, ``chat.PLAIN``).
"""

from megatron_offgrpo.data import _datasets as records  # records.load_local(...): the record loaders, one name
from megatron_offgrpo.data import _rewards as rewards  # rewards.get_reward(...): the reward registry, one name
from megatron_offgrpo.data import _turns as chat  # chat.turn_wrapping(...): an observation's turn, one name
from megatron_offgrpo.data._datasets import ASSETS, QARecord
from megatron_offgrpo.data._prompts import PromptStream, build_prompt
from megatron_offgrpo.data._sets import DataSets, load_datasets
from megatron_offgrpo.data._types import Prompt, Sample, SamplingParams

__all__ = [
    "ASSETS",
    "DataSets",
    "Prompt",
    "PromptStream",
    "QARecord",
    "Sample",
    "SamplingParams",
    "build_prompt",
    "chat",
    "load_datasets",
    "records",
    "rewards",
]
