"""Which of vLLM's runners a fleet serves a model with: ``generate`` (a causal LM: the policy, a teacher, a judge)
or ``pooling`` (a sequence classifier: a scalar reward model, ``*ForSequenceClassification``).

Read from the model's ``config.json`` ``architectures``, as vLLM itself picks its runner: a fleet started on a
classifier needs no flag, and a state records which runner its servers run so that a client that generates is
refused a classifier's fleet (and a scorer a generator's) in one line.
"""

from __future__ import annotations

from typing import Any, Literal

Runner = Literal["generate", "pooling"]
"""``generate``: text generation, prompt log-probs, weight refreshes. ``pooling``: one score per sequence
(vLLM's ``/classify``), the raw logit of a ``num_labels=1`` head."""

CLASSIFIER_SUFFIX = "ForSequenceClassification"

POOLER_CONFIG = {"use_activation": False}
"""vLLM's pooler settings of a classifier fleet: vLLM applies a sigmoid to a one-label head's output by default; a
reward is the raw logit (the sigmoid squashes large rewards together and is not what the model was trained to
output)."""


def runner_of(hf_config: dict[str, Any]) -> Runner:
    """``pooling`` when the config's ``architectures`` name a sequence classifier, else ``generate``."""
    architectures = hf_config.get("architectures") or []
    return "pooling" if any(str(a).endswith(CLASSIFIER_SUFFIX) for a in architectures) else "generate"
