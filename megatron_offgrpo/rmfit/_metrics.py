"""How well scores tell right from wrong completions: accuracy at logit 0, AUC, and within-group pairwise accuracy
(plain Python over the held-out samples' scores; a few thousand at most)."""

from __future__ import annotations

from typing import Sequence


def accuracy(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """The share of completions whose logit's sign is their label (> 0: right); NaN when empty."""
    if not scores:
        return float("nan")
    return sum((s > 0) == y for s, y in zip(scores, labels)) / len(scores)


def _pair_wins(right: Sequence[float], wrong: Sequence[float]) -> tuple[float, int]:
    """(pairs where the right one scores higher, ties counting a half; number of pairs)."""
    wins = sum(1.0 if r > w else 0.5 if r == w else 0.0 for r in right for w in wrong)
    return wins, len(right) * len(wrong)


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """The chance that a right completion scores above a wrong one, over every (right, wrong) pair (ties: a half):
    the ROC curve's area. None without both kinds."""
    wins, pairs = _pair_wins([s for s, y in zip(scores, labels) if y], [s for s, y in zip(scores, labels) if not y])
    return wins / pairs if pairs else None


def group_pairwise_accuracy(scores: Sequence[float], labels: Sequence[bool],
                            group_ids: Sequence[int]) -> float | None:
    """AUC within each group, pooled over the groups' pairs: what GRPO's group-relative advantage sees (a prompt's
    completions compared with each other only). None when no group has both kinds."""
    total_wins, total_pairs = 0.0, 0
    for group in sorted(set(group_ids)):
        mine = [(s, y) for s, y, g in zip(scores, labels, group_ids) if g == group]
        wins, pairs = _pair_wins([s for s, y in mine if y], [s for s, y in mine if not y])
        total_wins, total_pairs = total_wins + wins, total_pairs + pairs
    return total_wins / total_pairs if total_pairs else None


def score_report(scores: Sequence[float], labels: Sequence[bool], group_ids: Sequence[int]) -> dict[str, float | None]:
    """Accuracy, AUC and the within-group pairwise accuracy of ``scores``, with the majority class's accuracy (what
    a constant answer gets: the bar "better than chance" is measured against)."""
    right = sum(labels)
    return {"accuracy": accuracy(scores, labels), "auc": auc(scores, labels),
            "group_pairwise_accuracy": group_pairwise_accuracy(scores, labels, group_ids),
            "majority_accuracy": max(right, len(labels) - right) / len(labels) if labels else float("nan")}
