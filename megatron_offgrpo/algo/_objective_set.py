"""The objective family, one door name (``algo.objectives``): the name -> objective registry and every formula.

``objectives.get_objective("gspo")`` is the function ``ObjectiveParams.name`` picks; ``@objectives.register_objective``
adds one; ``objectives.sequence_log_ratio`` is GSPO's per-sequence log-ratio, which the fused kernel needs whole.
"""

from megatron_offgrpo.algo._objectives import (
    asymre,
    cispo,
    gpg,
    grpo_clip,
    gspo,
    importance_ratio,
    opmd,
    rec,
    rec_keep_mask,
    sequence_log_ratio,
)
from megatron_offgrpo.algo._registry import (
    ObjectiveFn,
    ObjectiveTerms,
    get_objective,
    objective_names,
    register_objective,
)

__all__ = [
    "ObjectiveFn",
    "ObjectiveTerms",
    "asymre",
    "cispo",
    "get_objective",
    "gpg",
    "grpo_clip",
    "gspo",
    "importance_ratio",
    "objective_names",
    "opmd",
    "rec",
    "rec_keep_mask",
    "register_objective",
    "sequence_log_ratio",
]
