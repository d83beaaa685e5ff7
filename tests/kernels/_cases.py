"""Shared inputs of the fused-loss tests (also imported by tests/workers/kernel_worker.py).

A batch is built the way the trainer builds it: G completions per prompt with rewards, group advantages from
algo (zero-variance groups masked), packed sequences with their prompt tokens masked out, behavior / reference /
fleet log-probs near the current policy's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, broadcast_to_tokens, compute_group_advantages


@dataclass
class Case:
    """Full (unsharded) inputs of one fused-loss call."""

    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    targets: torch.Tensor  # [N]
    behavior_logp: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # [N] bool, True = enters the loss
    params: ObjectiveParams
    kwargs: dict = field(default_factory=dict)  # ref_logp, fleet_logp, seq_ids, temperature, ...

    def tensors(self, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh leaf copies of ``(hidden, weight)`` requiring grad, cast to ``dtype``."""
        dtype = dtype or self.hidden.dtype
        return (self.hidden.detach().to(dtype).clone().requires_grad_(True),
                self.weight.detach().to(dtype).clone().requires_grad_(True))


def make_case(
    seed: int = 0,
    groups: int = 3,
    group_size: int = 4,
    seq_len: int = 6,
    hidden_size: int = 16,
    vocab: int = 48,
    params: Optional[ObjectiveParams] = None,
    zero_variance_groups: int = 1,
    with_ref: bool = True,
    with_fleet: bool = False,
    temperature: float = 1.0,
    entropy: bool = False,
) -> Case:
    """A packed GRPO batch of ``groups * group_size`` sequences of ``seq_len`` tokens (first 2 = prompt).

    Args:
        seed: RNG seed; everything is deterministic in it.
        groups: B prompts.
        group_size: G completions per prompt.
        seq_len: T tokens per sequence (N = B G T).
        hidden_size: H.
        vocab: V.
        params: objective switches (default ``ObjectiveParams()``).
        zero_variance_groups: how many groups get identical rewards (masked out by the advantage step).
        with_ref: pass reference log-probs.
        with_fleet: pass fleet log-probs (truncated IS).
        temperature: T.
        entropy: ask for the entropy metric.

    Returns:
        The case.
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = groups * group_size
    n = seqs * seq_len
    rewards = torch.randint(0, 2, (groups, group_size), generator=gen).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # every group has variance ...
    rewards[:zero_variance_groups] = 1.0  # ... except the first ones
    adv = compute_group_advantages(rewards, group_size, AdvantageParams())
    seq_ids = torch.arange(seqs).repeat_interleave(seq_len)
    response = (torch.arange(n) % seq_len) >= 2
    mask = response & broadcast_to_tokens(adv.sample_valid, seq_ids=seq_ids)
    hidden = torch.randn(n, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5 * 2
    targets = torch.randint(0, vocab, (n,), generator=gen)
    targets[~mask] = -100  # ignore ids where masked: the kernel must not look at them
    with torch.no_grad():
        safe = targets.clamp_min(0)
        logp = torch.log_softmax(hidden @ weight.t() / temperature, -1).gather(1, safe[:, None]).squeeze(1)
    behavior = logp + 0.3 * torch.randn(n, generator=gen)
    kwargs: dict = {"seq_ids": seq_ids, "temperature": temperature, "compute_entropy": entropy}
    if with_ref:
        kwargs["ref_logp"] = logp + 0.2 * torch.randn(n, generator=gen)
    if with_fleet:
        kwargs["fleet_logp"] = behavior + 0.05 * torch.randn(n, generator=gen)
    return Case(hidden, weight, targets, behavior, broadcast_to_tokens(adv.advantages, seq_ids=seq_ids), mask,
                params or ObjectiveParams(), kwargs)


TP_CASES = {
    "grpo_chunk5": dict(params=ObjectiveParams(), chunk_size=5, impl="torch"),
    "full_torch": dict(
        params=ObjectiveParams(kl_beta=0.05, dual_clip=3.0, aggregation="seq_mean_token_mean", tis_cap=2.0,
                               tis_level="sequence"),
        with_fleet=True, temperature=0.7, entropy=True, chunk_size=7, impl="torch",
    ),
    "full_triton": dict(
        params=ObjectiveParams(kl_beta=0.05, kl_estimator="k2", aggregation="seq_mean_token_mean"),
        temperature=0.7, entropy=True, chunk_size=16, impl="triton",
    ),
    "all_masked": dict(params=ObjectiveParams(), zero_variance_groups=3, chunk_size=4, impl="torch"),
    "gspo_torch": dict(params=ObjectiveParams(objective="gspo", seq_eps_low=0.05, seq_eps_high=0.05,
                                              aggregation="seq_mean_token_mean"), chunk_size=5, impl="torch"),
    "cispo_torch": dict(params=ObjectiveParams(objective="cispo", eps_high=0.1), chunk_size=5, impl="torch"),
}
"""Cases run under TP=2 by the worker and at TP=1 by the test: name -> make_case kwargs + chunk_size + impl."""


def tp_case(name: str) -> tuple[Case, int, str]:
    """``(case, chunk_size, impl)`` of a named TP case (V = 48, divisible by 2)."""
    spec = dict(TP_CASES[name])
    chunk, impl = spec.pop("chunk_size"), spec.pop("impl")
    return make_case(seed=7, **spec), chunk, impl


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise relative error ``||actual - expected|| / ||expected||`` (absolute when expected is 0)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff
