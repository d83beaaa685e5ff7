"""Core attention of the local layer spec through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores, masks them with
``masked_fill`` and runs an unfused softmax: on an H100 without Transformer Engine that was about 60% of a
Qwen2.5-0.5B training step (``benchmarks/gpu_step.py --profile``). SDPA picks FlashAttention on CUDA and a fused
kernel on CPU, never holds the scores, and computes the same function. An explicit boolean mask (packed rows:
``train._packing``) is the whole mask, causal part included, as megatron's unfused softmax takes it. Cases SDPA would
get wrong here (additive masks, THD packed sequences, sliding windows, attention dropout, softmax offsets,
query-key layer scaling) go to megatron's own implementation unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaAttention(DotProductAttention):
    """``DotProductAttention`` with the causal (or boolean-masked), dropout-free case on SDPA (same signature and
    output: ``[sq, b, heads * head_dim]`` from ``[s, b, heads or groups, head_dim]`` query / key / value)."""

    def _sdpa_applies(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask_ok = attention_mask is None or attention_mask.dtype == torch.bool
        return (mask_ok and attention_bias is None and packed_seq_params is None
                and mask_type == AttnMaskType.causal and self.softmax_offset is None
                and self.scale_mask_softmax.window_size is None
                and not self.config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0))

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]; grouped-query heads are matched by SDPA itself (no repeated K/V copies)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # a given mask is the whole mask, causal part included (as megatron's unfused softmax takes it): packed rows'
        # block-diagonal causal mask, shared-prompt rows' tree mask; SDPA's boolean mask says the opposite
        mask = None if attention_mask is None else ~attention_mask
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
        # [b, n, s, d] -> [s, b, n * d]
        return context.permute(2, 0, 1, 3).reshape(q.size(2), q.size(0), self.hidden_size_per_partition)
