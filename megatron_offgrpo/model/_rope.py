"""Rotary embeddings from each token's position id, for rows whose positions are not 0..s-1.

megatron-core's ``GPTModel`` asks its ``RotaryEmbedding`` for the angles of positions ``0..s-1`` of the row
(``rotary_pos_emb(rotary_seq_len)`` in ``_preprocess``); ``position_ids`` only feed learned absolute embeddings, which
Qwen does not have. That is right for a padded row, and for a packed row only up to rounding (a rotary score depends
on the query-key offset, and the block mask keeps each sequence to itself). It is wrong for a shared-prompt row
(``train._shared_prompt``): a branch token sits after the earlier branches in the row but must be at its own
sequence's position, P-1+t, for its offset to the shared prompt to be the unpacked one.

So when a stage is given an explicit attention mask (the packed and shared-prompt layouts), the angles are gathered
from the row's ``position_ids``: ``freqs[position_ids]``, ``[s, b, 1, d]``. The table is megatron's own (the same
``outer(arange, inv_freq)``), so every token gets bit for bit the angles of its position in the unpacked sequence,
and megatron's unfused ``apply_rotary_pos_emb`` broadcasts a per-row ``[s, b, 1, d]`` over the heads of
``[s, b, heads, d]`` as it does for mRoPE. Without a mask (the padded layout, probes, exports) megatron's path is
unchanged. TE's fused RoPE is never used (``apply_rope_fusion=False``); its THD path takes no per-token positions.

How the positions get there: a forward pre-hook on the stage hands ``position_ids`` (which every PP stage receives)
to its rotary module just before ``_preprocess`` runs, in the same call. A hook rather than a ``GPTModel`` subclass
because it needs none of ``forward``'s other arguments and leaves megatron's forward as it is.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding


class PositionRotaryEmbedding(RotaryEmbedding):
    """``RotaryEmbedding`` that, while ``position_ids`` ([b, s]) is set, returns the angles of those positions.

    Attributes:
        position_ids: [b, s] the row's positions, each < s; set per forward by ``use_position_ids``'s hook (None: the
            positions 0..s-1 of every row, megatron's own ``[s, 1, 1, d]``).
    """

    position_ids: torch.Tensor | None = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> torch.Tensor:
        table = super().forward(max_seq_len, offset, packed_seq, cp_group)  # [s, 1, 1, d], megatron's (cached)
        if self.position_ids is None:
            return table
        # [s, d][s, b] -> [s, b, d] -> [s, b, 1, d]; positions are < s (a token's position in its own sequence)
        return table[:, 0, 0][self.position_ids.t().to(table.device)].unsqueeze(2)


def _positions_to_rotary(stage, args, kwargs) -> None:
    """Forward pre-hook of a ``GPTModel`` stage: ``forward(input_ids, position_ids, attention_mask, ...)``."""
    named = ("input_ids", "position_ids", "attention_mask")
    given = dict(zip(named, args)) | {k: v for k, v in kwargs.items() if k in named}
    explicit = given.get("attention_mask") is not None and given.get("position_ids") is not None
    stage.rotary_pos_emb.position_ids = given["position_ids"] if explicit else None


def use_position_ids(stage: torch.nn.Module) -> torch.nn.Module:
    """Make ``stage`` (a ``GPTModel`` with RoPE) take rotary angles from ``position_ids`` whenever it is also given an
    attention mask. Replaces its ``rotary_pos_emb`` by a ``PositionRotaryEmbedding`` of the same frequencies (no
    parameters: state dicts are unchanged) and registers the hook. Returns ``stage``."""
    old = stage.rotary_pos_emb
    new = PositionRotaryEmbedding.__new__(PositionRotaryEmbedding)
    new.__dict__.update(old.__dict__)  # inv_freq, interleaving, interpolation, cp group: megatron's own
    stage.rotary_pos_emb = new
    stage.register_forward_pre_hook(_positions_to_rotary, with_kwargs=True)
    return stage
