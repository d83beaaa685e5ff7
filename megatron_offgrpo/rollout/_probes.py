"""Post-refresh verification, one door name (``rollout.probes``): the probe sequence, the check, its tolerances.

``probes.verify_refresh(engine, probes.make_probe_ids(vocab), trainer_logprobs, version, probes.probe_atol(dtype))``
checks the fleet's log-probs of a fixed probe against the trainer's; ``probe_bound`` derives a float32 tolerance from
the model's sizes, ``PROBE_ATOL`` is the per-dtype default table.
"""

from megatron_offgrpo.rollout._types import PROBE_ATOL, probe_atol, probe_bound
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh

__all__ = ["PROBE_ATOL", "make_probe_ids", "probe_atol", "probe_bound", "verify_refresh"]
