"""The fused GRPO loss: hidden states x output-layer shard -> vocab-parallel log-probs -> loss and grads,
without [N, V] logits.

    loss, metrics = fused_linear_grpo_loss(hidden, weight_shard, targets, behavior_logp, advantages, loss_mask,
                                           ObjectiveParams(...), tp_group=tp_group)
    loss.backward()     # grads of hidden (all-reduced over tp_group) and of this rank's weight shard

Two implementations behind one interface (``impl``): chunked torch ops (any device) and Triton kernels for the
elementwise stages (CUDA; CPU under ``TRITON_INTERPRET=1`` for tests). Both equal ``algo.reference_loss`` on the
materialised logits; the objective formulas live only in ``algo``.

Shape notation: N tokens, H hidden, V vocabulary, V/tp rows of this rank's vocab shard.
"""

from megatron_offgrpo.kernels._api import (
    DEFAULT_CHUNK_BYTES,
    default_chunk_size,
    fused_linear_grpo_loss,
    resolve_impl,
    vocab_parallel_logprobs,
)
from megatron_offgrpo.kernels._triton_ops import HAVE_TRITON

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HAVE_TRITON",
    "default_chunk_size",
    "fused_linear_grpo_loss",
    "resolve_impl",
    "vocab_parallel_logprobs",
]
