"""Data: prompt/sample types, prompt datasets, chat templates and verifiable rewards."""

from megatron_offgrpo.data._types import Prompt, Sample, SamplingParams

__all__ = ["Prompt", "Sample", "SamplingParams"]
