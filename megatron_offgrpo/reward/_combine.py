"""The reward trained on, from the rule's and the model's: clip, per-group standardisation, weights."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Sequence

GROUP_STD_EPS = 1e-6
"""A group whose scores are all equal (std below this) standardises to zeros, not to a division by zero."""


@dataclasses.dataclass(frozen=True)
class RewardMix:
    """How a group's rule rewards and model scores make its rewards (``reward.*`` of the config).

    Attributes:
        rule_weight, model_weight: the weights. clip: scores clipped to [-clip, clip] first (None: not).
        normalize: "group": scores standardised within the group after the clip; "none": as given.
    """

    rule_weight: float = 1.0
    model_weight: float = 1.0
    clip: float | None = None
    normalize: Literal["none", "group"] = "none"

    def shaped(self, scores: Sequence[float]) -> list[float]:
        """One group's model scores as they enter the reward: clipped, then (``group``) standardised with the
        population std, as the group advantages use."""
        values = [min(max(s, -self.clip), self.clip) if self.clip is not None else s for s in scores]
        if self.normalize == "group" and values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
            values = [0.0 if std < GROUP_STD_EPS else (v - mean) / std for v in values]
        return values

    def rewards(self, rule: Sequence[float], scores: Sequence[float]) -> list[float]:
        """One group's rewards: ``rule_weight * rule + model_weight * shaped score``."""
        return [self.rule_weight * r + self.model_weight * s for r, s in zip(rule, self.shaped(scores), strict=True)]
