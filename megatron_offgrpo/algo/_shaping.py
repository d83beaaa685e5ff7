"""Reward shaping by response length: DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", section 3.4)."""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float = 1.0) -> float:
    """The (non-positive) reward added to a response of ``length`` tokens out of at most ``max_tokens``.

    0 up to ``max_tokens - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_tokens``: a response
    that runs into the length limit is punished softly, in proportion to how far into the last ``buffer`` tokens it
    went, instead of the cliff of a truncated answer scoring like a wrong one. ``buffer = 0``: no shaping.
    """
    if buffer <= 0:
        return 0.0
    over = length - (max_tokens - buffer)
    return -penalty * min(max(over, 0), buffer) / buffer
