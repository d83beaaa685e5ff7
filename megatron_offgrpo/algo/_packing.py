"""Packed-layout helpers: which sequence each flattened token belongs to.

The trainer packs S sequences into one flat token axis. A layout is given either as ``seq_ids`` (the
sequence index of every token) or as ``cu_seqlens`` (cumulative boundaries, as in flash-attention varlen).

Shape notation: N = tokens flattened over the packed batch, S = sequences (samples) in the pack.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_offgrpo.algo._checks import check_1d


def resolve_seq_ids(
    num_tokens: int,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, int]:
    """Turns either layout description into per-token sequence ids.

    Args:
        num_tokens: N, the length of the flattened token axis.
        seq_ids: [N] integer sequence index of each token, values in [0, S).
        cu_seqlens: [S + 1] integer boundaries: sequence s holds tokens ``cu_seqlens[s]:cu_seqlens[s + 1]``;
            starts at 0, non-decreasing, ends at N.

    Returns:
        ``(seq_ids [N] int64, S)``. With ``seq_ids`` given, S = ``max(seq_ids) + 1`` (0 if N = 0).

    Raises:
        ValueError: if neither or both are given, or if the layout is malformed.
    """
    if (seq_ids is None) == (cu_seqlens is None):
        raise ValueError(
            "pass exactly one of seq_ids or cu_seqlens to describe the packed layout "
            f"(got seq_ids={'set' if seq_ids is not None else None}, "
            f"cu_seqlens={'set' if cu_seqlens is not None else None})"
        )
    if seq_ids is not None:
        check_1d("seq_ids", seq_ids, num_tokens)
        if seq_ids.dtype.is_floating_point or seq_ids.dtype == torch.bool:
            raise ValueError(f"seq_ids has dtype {seq_ids.dtype}; it must be an integer tensor; cast with .long()")
        if num_tokens == 0:
            return seq_ids.long(), 0
        if int(seq_ids.min()) < 0:
            raise ValueError(f"seq_ids has a negative value {int(seq_ids.min())}; ids must be in [0, S)")
        return seq_ids.long(), int(seq_ids.max()) + 1
    assert cu_seqlens is not None
    check_1d("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens (dtype {cu_seqlens.dtype}, {cu_seqlens.numel()} entries) must be an integer tensor "
            "of S + 1 >= 1 boundaries"
        )
    bounds = cu_seqlens.long().cpu()
    lengths = bounds[1:] - bounds[:-1]
    if int(bounds[0]) != 0 or int(bounds[-1]) != num_tokens or bool((lengths < 0).any()):
        raise ValueError(
            f"cu_seqlens={bounds.tolist()[:8]}{'...' if bounds.numel() > 8 else ''} must start at 0, never "
            f"decrease, and end at N={num_tokens}; rebuild it from the sequence lengths"
        )
    num_seqs = lengths.numel()
    ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    return ids.to(cu_seqlens.device), num_seqs


def broadcast_to_tokens(
    per_sample: torch.Tensor,
    seq_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Copies a per-sequence value (an advantage, a validity flag) onto every token of that sequence.

    Args:
        per_sample: [S] one value per sequence (any dtype; bool masks keep their meaning).
        seq_ids: [N] sequence index of each token (give this or ``cu_seqlens``).
        cu_seqlens: [S + 1] packed boundaries (give this or ``seq_ids``).

    Returns:
        [N] ``per_sample[seq_id of token]``.

    Raises:
        ValueError: if the layout is malformed or refers to more sequences than ``per_sample`` has.
    """
    check_1d("per_sample", per_sample)
    if seq_ids is not None:
        n = check_1d("seq_ids", seq_ids).shape[0]
    else:  # N is implied by the layout; resolve_seq_ids checks the rest
        n = int(cu_seqlens[-1]) if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.numel() else 0
    ids, num_seqs = resolve_seq_ids(n, seq_ids, cu_seqlens)
    if num_seqs > per_sample.shape[0]:
        raise ValueError(
            f"the layout has S={num_seqs} sequences but per_sample has {per_sample.shape[0]} values; "
            "pass one value per sequence"
        )
    return per_sample[ids.to(per_sample.device)]


def segment_sum(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Sums per-token values within each sequence (differentiable w.r.t. ``values``).

    Args:
        values: [N] per-token values.
        seq_ids: [N] int64 sequence index of each token, in [0, num_seqs).
        num_seqs: S.

    Returns:
        [S] per-sequence sums (0 for sequences without tokens).
    """
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_ids.to(values.device), values)
