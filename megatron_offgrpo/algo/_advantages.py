"""Group-relative advantages, the zero-variance mask, GPG scaling and RED-Drop.

For each prompt, G completions are scored; sample i of a group with kept rewards ``r`` (k of them) gets

    sqrt_var (seed paper, Mroueh et al. "Revisiting GRPO"):  A_i = (r_i - mean r) / sqrt(var_pop r + eps)
    std_eps  (DeepSeekMath / TRL):                           A_i = (r_i - mean r) / (std_unbiased r + eps)
    std_normalize=False (Dr.GRPO):                           A_i =  r_i - mean r

where ``var_pop = sum (r - mean)^2 / k`` and ``std_unbiased = sqrt(sum (r - mean)^2 / (k - 1))``. With
``leave_one_out`` the baseline is the mean of the other k - 1 kept samples, i.e. the numerator becomes
``k / (k - 1) * (r_i - mean r)``; the denominator is unchanged.

Shape notation: B = prompts (groups), G = completions per prompt (group size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_offgrpo.algo._params import AdvantageParams


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of a batch of groups, with the masks the loss needs.

    Attributes:
        advantages: [B*G] advantage per sample, group-major (sample g of group b at ``b * G + g``); exactly 0 for
            zero-variance groups and for dropped samples.
        sample_valid: [B*G] bool, True = the sample contributes to the loss and its tokens count in the loss
            normaliser; False = in a masked zero-variance group, or dropped by RED-Drop.
        group_valid: [B] bool, True = the group's rewards are not all equal (it carries a learning signal).
        dropped: [B*G] bool, True = removed by RED-Drop (always False without ``red_drop``).
        group_mean: [B] the baseline mean over the kept samples of each group.
        group_denominator: [B] what the centred rewards were divided by (1 without ``std_normalize`` and
            for zero-variance groups).
        scale: 0-dim, the GPG factor ``B / max(1, #valid groups)`` applied (1 without ``gpg_scale``).
        masked_group_fraction: 0-dim, fraction of groups masked out for zero variance (0 when masking is off).
        zero_variance_fraction: 0-dim, fraction of groups whose rewards are all equal (masked or not).
        dropped_fraction: 0-dim, fraction of samples dropped by RED-Drop.
    """

    advantages: torch.Tensor
    sample_valid: torch.Tensor
    group_valid: torch.Tensor
    dropped: torch.Tensor
    group_mean: torch.Tensor
    group_denominator: torch.Tensor
    scale: torch.Tensor
    masked_group_fraction: torch.Tensor
    zero_variance_fraction: torch.Tensor
    dropped_fraction: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        """Returns detached scalar metrics for logging (``advantage_abs_mean`` is over all B*G samples)."""
        return {
            "masked_group_fraction": self.masked_group_fraction,
            "zero_variance_fraction": self.zero_variance_fraction,
            "dropped_fraction": self.dropped_fraction,
            "gpg_scale": self.scale,
            "advantage_abs_mean": self.advantages.abs().mean(),
        }


def _as_groups(rewards: object, group_size: object) -> torch.Tensor:
    """Validates ``rewards`` and returns them as a detached floating [B, G] tensor."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}; pass torch.tensor(...)")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(
            f"group_size={group_size!r}: a group-relative baseline needs at least 2 completions per prompt "
            "(with G = 1 every advantage is 0); sample n >= 2 completions and pass group_size >= 2"
        )
    if rewards.dim() not in (1, 2):
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; it must be [B*G] or [B, G]")
    if rewards.dim() == 2 and rewards.shape[1] != group_size:
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)} but group_size={group_size}; the second dim of "
            "[B, G] rewards must equal group_size"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty (B = 0 groups); pass at least one group of group_size rewards")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} values, not a multiple of group_size={group_size}; every prompt "
            "must contribute exactly group_size rewards (pad or drop incomplete groups before this call)"
        )
    if rewards.is_complex():
        raise ValueError(f"rewards has dtype {rewards.dtype}; rewards must be real")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = ~torch.isfinite(rewards.reshape(-1))
    if bool(bad.any()):
        where = bad.nonzero().flatten()[:5].tolist()
        raise ValueError(
            f"rewards has {int(bad.sum())} non-finite value(s) (NaN/inf) at flat index {where}; "
            "fix the reward function or drop those groups before computing advantages"
        )
    return rewards.detach().reshape(-1, group_size)


def _red_drop(r: torch.Tensor, group_valid: torch.Tensor, generator: Optional[torch.Generator]) -> torch.Tensor:
    """RED-Drop: picks the surplus negatives of each group to drop.

    Positives are ``r >= mean`` and negatives ``r < mean`` (group mean over all G samples). If a group has
    more negatives than positives, ``#neg - #pos`` negatives are dropped: the highest-index ones (samples of a
    group are exchangeable i.i.d. draws, so this equals random dropping in distribution), or a uniformly
    random choice when ``generator`` is given. Zero-variance groups never drop anything.

    Args:
        r: [B, G] rewards.
        group_valid: [B] bool, True = not zero-variance.
        generator: optional RNG for a random choice of the dropped negatives.

    Returns:
        [B, G] bool, True = dropped.
    """
    neg = r < r.mean(dim=1, keepdim=True)
    surplus = (2 * neg.sum(dim=1) - r.shape[1]).clamp_min(0)  # #neg - #pos, floored at 0
    if generator is None:
        priority = torch.arange(r.shape[1], device=r.device).expand_as(r)
    else:
        priority = torch.rand(r.shape, generator=generator, device=r.device)
    # rank[b, i] = number of negatives of group b with a higher priority than sample i
    higher = priority.unsqueeze(1) > priority.unsqueeze(2)  # [B, G(i), G(j)]: prio_j > prio_i
    rank = (higher & neg.unsqueeze(1)).sum(dim=2)
    return neg & (rank < surplus.unsqueeze(1)) & group_valid.unsqueeze(1)


def _centre_and_scale(
    r: torch.Tensor, keep: torch.Tensor, group_valid: torch.Tensor, params: AdvantageParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centres and normalises kept rewards per group.

    Args:
        r: [B, G] rewards.
        keep: [B, G] bool, True = the sample is kept (not dropped by RED-Drop).
        group_valid: [B] bool, True = not zero-variance.
        params: estimator switches.

    Returns:
        ``(advantages [B, G], mean [B, 1], denominator [B, 1])``; advantages are 0 where not
        ``keep & group_valid``.
    """
    k = keep.sum(dim=1, keepdim=True).to(r.dtype)  # >= 2: RED-Drop keeps 2 * #pos >= 2 samples
    mean = torch.where(keep, r, 0).sum(dim=1, keepdim=True) / k
    sq_dev = torch.where(keep, (r - mean) ** 2, 0).sum(dim=1, keepdim=True)
    centered = r - mean
    if params.leave_one_out:
        centered = centered * (k / (k - 1))  # r_i - (sum_kept - r_i) / (k - 1)
    if not params.std_normalize:
        denom = torch.ones_like(mean)
    elif params.form == "sqrt_var":
        denom = torch.sqrt(sq_dev / k + params.eps)
    else:
        denom = torch.sqrt(sq_dev / (k - 1)) + params.eps
    denom = torch.where(group_valid.unsqueeze(1), denom, 1)  # zero-variance: avoid 0/0 when eps == 0
    adv = torch.where(group_valid.unsqueeze(1) & keep, centered / denom, 0)
    return adv, mean, denom


def compute_group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    params: Optional[AdvantageParams] = None,
    *,
    generator: Optional[torch.Generator] = None,
) -> GroupAdvantages:
    """Computes group-relative advantages (see the module docstring for the formulas).

    Order of operations: zero-variance detection on all G rewards -> RED-Drop -> mean / spread over the kept
    samples -> (leave-one-out) centring -> (std) normalisation -> zero for zero-variance groups and dropped
    samples -> GPG scale. A group is zero-variance when ``max(r) == min(r)`` exactly.

    Args:
        rewards: [B*G] (group-major) or [B, G] rewards; real, finite. Integer/bool rewards are cast to the
            default float dtype.
        group_size: G >= 2.
        params: estimator switches; defaults to ``AdvantageParams()``.
        generator: RNG for RED-Drop's random choice; None = deterministic (drop the highest-index negatives).

    Returns:
        A :class:`GroupAdvantages`; every tensor is detached, on the rewards' device.

    Raises:
        ValueError: on non-tensor, empty, non-finite or complex rewards, a count not divisible by
            ``group_size``, a [B, G] shape that disagrees with ``group_size``, or ``group_size < 2``.
    """
    params = params if params is not None else AdvantageParams()
    r = _as_groups(rewards, group_size)
    num_groups = r.shape[0]
    group_valid = r.amax(dim=1) != r.amin(dim=1)
    dropped = _red_drop(r, group_valid, generator) if params.red_drop else torch.zeros_like(r, dtype=torch.bool)
    keep = ~dropped
    adv, mean, denom = _centre_and_scale(r, keep, group_valid, params)
    n_valid = group_valid.sum()
    scale = num_groups / n_valid.clamp_min(1).to(r.dtype) if params.gpg_scale else r.new_ones(())
    sample_valid = keep & group_valid.unsqueeze(1) if params.mask_zero_variance else keep
    zero_var = (~group_valid).to(r.dtype).mean()
    return GroupAdvantages(
        advantages=(adv * scale).reshape(-1),
        sample_valid=sample_valid.reshape(-1),
        group_valid=group_valid,
        dropped=dropped.reshape(-1),
        group_mean=mean.squeeze(1),
        group_denominator=denom.squeeze(1),
        scale=scale,
        masked_group_fraction=zero_var if params.mask_zero_variance else r.new_zeros(()),
        zero_variance_fraction=zero_var,
        dropped_fraction=dropped.to(r.dtype).mean(),
    )
