"""The reference loss's parts, one door name (``algo.loss_parts``): what the fused kernel recomposes chunk-wise.

``reference_loss`` is ``token_loss`` (objective x truncated-IS factor + beta x KL, masked) then ``aggregate`` and
``finalize_metrics``; the kernel computes ``logp`` chunk by chunk and calls the same parts, with the packed layout's
helpers (``resolve_seq_ids``, ``segment_sum``), the truncated-IS weights and the KL estimators.
"""

from megatron_offgrpo.algo._aggregate import aggregate
from megatron_offgrpo.algo._kl import LOG_RATIO_CLAMP, kl_penalty
from megatron_offgrpo.algo._packing import resolve_seq_ids, segment_sum
from megatron_offgrpo.algo._tis import truncated_is_weights
from megatron_offgrpo.algo._token_loss import finalize_metrics, token_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "aggregate",
    "finalize_metrics",
    "kl_penalty",
    "resolve_seq_ids",
    "segment_sum",
    "token_loss",
    "truncated_is_weights",
]
