"""Rewards from models: a scalar reward model (a sequence classifier) or a generative judge scores completions on
rank 0, in process (transformers, CPU) or on a vLLM fleet of its own, and its scores mix with the rule's.

``RewardModel.open(RewardSpec(...))`` loads or connects; ``score_group`` scores one group and sets its rewards
(``RewardMix``: weights, clip, per-group standardisation). ``JudgeTemplate`` and ``parse_verdict`` keep the policy's
text as data in a judge's prompt and read the verdict from the judge's reply only (``_template``: how). Nothing here
imports megatron or the config: ``sampler`` builds the spec from ``reward.*``.
"""

from megatron_offgrpo.reward._combine import RewardMix
from megatron_offgrpo.reward._judge import JudgeSettings
from megatron_offgrpo.reward._scoring import RewardModel, RewardSpec
from megatron_offgrpo.reward._template import JudgeTemplate, TemplateError, parse_verdict
from megatron_offgrpo.reward._types import ModelScore, RewardModelError, ScoreRequest

__all__ = ["JudgeSettings", "JudgeTemplate", "ModelScore", "RewardMix", "RewardModel", "RewardModelError",
           "RewardSpec", "ScoreRequest", "TemplateError", "parse_verdict"]
