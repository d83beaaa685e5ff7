"""Pure tensor math of off-policy GRPO: advantages, masks, objectives, KL, truncated IS, the reference loss.

No distributed calls and no I/O: this package is the oracle the fused kernel and the trainer are tested
against. Flow for one batch:

    adv = compute_group_advantages(rewards, G, AdvantageParams(...))        # [B*G]
    tok_adv = broadcast_to_tokens(adv.advantages, seq_ids=seq_ids)           # [N]
    mask = response_mask & broadcast_to_tokens(adv.sample_valid, seq_ids=seq_ids)
    loss, metrics = reference_loss(logits, targets, behavior_logp, tok_adv, mask, ObjectiveParams(...))

The fused kernel replaces ``reference_loss`` by computing ``logp`` chunk-wise and calling ``token_loss`` then
``aggregate``.

Shape notation (all docstrings): B prompts (groups), G completions per prompt, T tokens of one sequence,
N tokens flattened over the packed batch, S sequences in the pack (S = B*G when every sample is packed),
V vocabulary. Every mask says what True means.
"""

from megatron_offgrpo.algo._advantages import GroupAdvantages, compute_group_advantages
from megatron_offgrpo.algo._aggregate import aggregate
from megatron_offgrpo.algo._distill import distill_advantages, reverse_kl_sums
from megatron_offgrpo.algo._kl import LOG_RATIO_CLAMP, kl_penalty
from megatron_offgrpo.algo._objectives import (
    asymre,
    cispo,
    gpg,
    gspo,
    grpo_clip,
    importance_ratio,
    opmd,
    rec,
    rec_keep_mask,
    sequence_log_ratio,
)
from megatron_offgrpo.algo._packing import broadcast_to_tokens, resolve_seq_ids, segment_sum
from megatron_offgrpo.algo._params import AdvantageParams, ObjectiveParams
from megatron_offgrpo.algo._reference import reference_loss
from megatron_offgrpo.algo._shaping import overlong_penalty
from megatron_offgrpo.algo._registry import (
    ObjectiveFn,
    ObjectiveTerms,
    get_objective,
    objective_names,
    register_objective,
)
from megatron_offgrpo.algo._tis import truncated_is_weights
from megatron_offgrpo.algo._token_loss import finalize_metrics, token_loss

__all__ = [
    "LOG_RATIO_CLAMP",
    "AdvantageParams",
    "GroupAdvantages",
    "ObjectiveFn",
    "ObjectiveParams",
    "ObjectiveTerms",
    "aggregate",
    "distill_advantages",
    "asymre",
    "broadcast_to_tokens",
    "cispo",
    "compute_group_advantages",
    "finalize_metrics",
    "get_objective",
    "gpg",
    "gspo",
    "grpo_clip",
    "importance_ratio",
    "kl_penalty",
    "objective_names",
    "opmd",
    "overlong_penalty",
    "rec",
    "rec_keep_mask",
    "reference_loss",
    "reverse_kl_sums",
    "register_objective",
    "resolve_seq_ids",
    "segment_sum",
    "sequence_log_ratio",
    "token_loss",
    "truncated_is_weights",
]
