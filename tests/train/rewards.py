"""Rewards for trainer tests: random-looking but deterministic, so groups of a random model have variance (or, by
design, do not)."""


def even_length(completion: str, answer: str | None) -> float:
    """1.0 when the completion has an even number of characters."""
    return 1.0 if len(completion) % 2 == 0 else 0.0


def answer_value(answer: str | None) -> int:
    """The arithmetic task's ground truth as an int (``"#### 12"`` -> 12)."""
    return int(str(answer).rsplit("#", 1)[-1])


def odd_answers_score_zero(completion: str, answer: str | None) -> float:
    """0.0 for every completion of a prompt whose answer is odd (its group never has variance: dynamic sampling must
    drop it); ``even_length`` for the others (their groups of a random model usually have variance)."""
    return 0.0 if answer_value(answer) % 2 else even_length(completion, answer)


def always_zero(completion: str, answer: str | None) -> float:
    """0.0 whatever the completion: a task too hard for the policy, every group degenerate."""
    return 0.0
