"""The reward model's losses on one batch of scored completions (pure tensor math).

Shape notation: S completions in the batch (whole groups of G, so S = groups x G). ``labels`` [S] is True where the
completion is right (its rule reward >= 1); ``group_ids`` [S] is the same for the completions of one prompt.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F


def bce_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy of each completion's logit ``scores`` [S] against its label [S] (True = right):
    ``softplus(-s)`` for a right one, ``softplus(s)`` for a wrong one; the logit is then the log-odds of right."""
    return F.binary_cross_entropy_with_logits(scores, labels.to(scores.dtype))


def pairwise_loss(scores: torch.Tensor, labels: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry: the mean over every pair (i right, j wrong) of one group of ``-log sigmoid(s_i - s_j)``, i.e.
    ``softplus(s_j - s_i)``. Pairs never cross groups: a prompt's completions are compared with each other only, so
    a question's difficulty is not what the score learns. A batch without a pair: 0 (with a graph, no gradient).

    Args:
        scores: [S] logits. labels: [S] True where right. group_ids: [S] the prompt's group of each completion.
    """
    pairs = (group_ids[:, None] == group_ids[None, :]) & labels[:, None] & ~labels[None, :]  # [S, S] True: i over j
    if not bool(pairs.any()):
        return scores.sum() * 0.0
    margins = scores[:, None] - scores[None, :]  # [S, S] s_i - s_j
    return F.softplus(-margins[pairs]).mean()


def rm_loss(kind: Literal["bce", "pairwise"], scores: torch.Tensor, labels: torch.Tensor,
            group_ids: torch.Tensor) -> torch.Tensor:
    """``rm.loss``'s loss of one batch (``bce_loss`` or ``pairwise_loss``)."""
    if kind == "bce":
        return bce_loss(scores, labels)
    if kind == "pairwise":
        return pairwise_loss(scores, labels, group_ids)
    raise ValueError(f"rm.loss={kind!r}: expected 'bce' or 'pairwise'")
