"""RMSNorm for the local layer spec that also runs under sequence parallelism.

megatron-core's local spec builds its norms through ``WrappedTorchNorm``, which refuses ``sequence_parallel`` (its
assert says torch's norm is not supported there), and its SP-capable norms need apex or Transformer Engine, neither
of which a CPU machine has. An RMSNorm normalises each position on its own, so it computes the same function on the
``[s/tp, b, H]`` shard of a sequence-parallel region as on the whole row; what sequence parallelism adds is that each
TP rank's weight gradient covers only its own positions. Megatron's ``finalize_model_grads`` sums those over TP for
every parameter marked ``sequence_parallel`` (as TE's and apex's norms mark theirs); this norm marks its weight so.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig


class QwenRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor, whose weight is marked for the sequence-parallel grad
    all-reduce when ``config.sequence_parallel`` is on (state-dict names are unchanged: ``weight``).

    Args:
        config: the model's ``TransformerConfig``. hidden_size: the normalised size (H, or head_dim for q/k norms).
        eps: the epsilon. Other keywords of megatron's norm interface are accepted and must be their defaults.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm") -> None:
        # fail loudly on what this norm does not compute rather than silently differing from megatron's
        assert normalization == "RMSNorm" and not zero_centered_gamma and not config.layernorm_zero_centered_gamma
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
