"""Name -> objective registry.

An objective maps per-token log-probs to a per-token policy loss. Objectives register themselves by a short
name (``@register_objective("grpo_clip")``); :class:`~megatron_offgrpo.algo.ObjectiveParams` picks one by that
name and a miss lists every valid name.

Shape notation: N = tokens flattened over the packed batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover - typing only
    from megatron_offgrpo.algo._params import ObjectiveParams


@dataclass(frozen=True)
class ObjectiveTerms:
    """What an objective returns for a chunk of tokens.

    Attributes:
        loss: [N] per-token policy loss, differentiable w.r.t. ``logp``; not yet masked or weighted.
        clip_low: [N] bool, True = the token's gradient was removed because the ratio is below the trust
            region (``rho < 1 - eps_low``).
        clip_high: [N] bool, True = the token's gradient was removed because the ratio is above the trust
            region (``rho > 1 + eps_high``).
        dual_clip: [N] bool, True = the dual clip bound ``-c * A`` was active (A < 0, rho > c).
    """

    loss: torch.Tensor
    clip_low: torch.Tensor
    clip_high: torch.Tensor
    dual_clip: torch.Tensor


class ObjectiveFn(Protocol):
    """A registered objective: pure elementwise torch math over [N] tensors."""

    def __call__(
        self,
        logp: torch.Tensor,
        behavior_logp: torch.Tensor,
        advantages: torch.Tensor,
        params: ObjectiveParams,
    ) -> ObjectiveTerms:
        """Per-token policy loss.

        Args:
            logp: [N] log-prob of each target token under the current policy (requires grad).
            behavior_logp: [N] log-prob under the behavior policy that generated the sample (no grad).
            advantages: [N] advantage of the token's sample, broadcast to its tokens.
            params: the objective's switches.

        Returns:
            The unmasked per-token loss [N] and the clip flags.
        """


_OBJECTIVES: dict[str, ObjectiveFn] = {}


def register_objective(name: str) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator that registers an objective function under ``name``.

    Args:
        name: short registry name; must not be taken already.

    Returns:
        The decorator, which returns the function unchanged.

    Raises:
        ValueError: if ``name`` is already registered.
    """

    def decorator(fn: ObjectiveFn) -> ObjectiveFn:
        if name in _OBJECTIVES:
            raise ValueError(
                f"objective name={name!r} is already registered (by {_OBJECTIVES[name]!r}); "
                "names must be unique: pick another name"
            )
        _OBJECTIVES[name] = fn
        return fn

    return decorator


def objective_names() -> tuple[str, ...]:
    """Returns the registered objective names, sorted."""
    return tuple(sorted(_OBJECTIVES))


def get_objective(name: str) -> ObjectiveFn:
    """Looks an objective up by name.

    Args:
        name: registry name, e.g. ``"grpo_clip"``.

    Returns:
        The registered objective function.

    Raises:
        ValueError: if ``name`` is not registered; the message lists the valid names.
    """
    try:
        return _OBJECTIVES[name]
    except KeyError:
        raise ValueError(
            f"objective={name!r} is not a registered objective; valid names: {', '.join(objective_names())}"
        ) from None
