"""Pure tensor math of off-policy GRPO: advantages, masks, objectives, KL, truncated IS, the reference loss.

No distributed calls and no I/O: this package is the oracle the fused kernel and the trainer are tested
against. Flow for one batch:

    adv = compute_group_advantages(rewards, G, AdvantageParams(...))        # [B*G]
    tok_adv = broadcast_to_tokens(adv.advantages, seq_ids=seq_ids)           # [N]
    mask = response_mask & broadcast_to_tokens(adv.sample_valid, seq_ids=seq_ids)
    loss, metrics = reference_loss(logits, targets, behavior_logp, tok_adv, mask, ObjectiveParams(...))

The fused kernel replaces ``reference_loss`` by computing ``logp`` chunk-wise and calling its parts
(``loss_parts``: ``token_loss`` then ``aggregate``). The objectives, their registry and formulas, are ``objectives``.

Shape notation (all docstrings): B prompts (groups), G completions per prompt, T tokens of one sequence,
N tokens flattened over the packed batch, S sequences in the pack (S = B*G when every sample is packed),
V vocabulary. Every mask says what True means.
"""

from megatron_offgrpo.algo import _loss_parts as loss_parts  # loss_parts.token_loss(...): the fused kernel's parts
from megatron_offgrpo.algo import _objective_set as objectives  # objectives.get_objective(...): registry + formulas
from megatron_offgrpo.algo._advantages import GroupAdvantages, compute_group_advantages
from megatron_offgrpo.algo._distill import distill_advantages, reverse_kl_sums
from megatron_offgrpo.algo._packing import broadcast_to_tokens
from megatron_offgrpo.algo._params import AdvantageParams, ObjectiveParams
from megatron_offgrpo.algo._reference import reference_loss
from megatron_offgrpo.algo._shaping import overlong_penalty

__all__ = [
    "AdvantageParams",
    "GroupAdvantages",
    "ObjectiveParams",
    "broadcast_to_tokens",
    "compute_group_advantages",
    "distill_advantages",
    "loss_parts",
    "objectives",
    "overlong_penalty",
    "reference_loss",
    "reverse_kl_sums",
]
