"""A reward for trainer tests: random-looking but deterministic, so groups of a random model have variance."""


def even_length(completion: str, answer: str | None) -> float:
    """1.0 when the completion has an even number of characters."""
    return 1.0 if len(completion) % 2 == 0 else 0.0
