"""Validation of the fused loss's own arguments (the per-token ones are checked by algo).

Every user error is a ``ValueError`` naming the argument, its value, the rule and the fix. Checks read shapes
and dtypes, plus one value scan of the targets (a host sync once per call, not per chunk; none when the caller
passes ``valid_rows`` and has checked its targets itself, as the trainer does on the CPU).

Shape notation: N tokens, H hidden, V/tp vocabulary rows of this rank's shard.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

IMPLS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_linear(hidden: object, weight: object) -> None:
    """Checks ``hidden`` [N, H] and ``weight`` [V/tp, H]: floating, same dtype and device.

    Args:
        hidden: the hidden states.
        weight: this rank's output-layer shard.

    Raises:
        ValueError: naming the first broken rule.
    """
    for name, value in (("hidden", hidden), ("weight", weight)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() != 2:
            layout = "[N, H]" if name == "hidden" else "[V/tp, H]"
            raise ValueError(
                f"{name} has shape {tuple(value.shape)}; it must be 2-D {layout}; flatten sequence and batch dims first"
            )
        if value.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {value.dtype}; use one of {_FLOAT_DTYPES}")
    assert isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden has H={hidden.shape[1]} but weight has shape {tuple(weight.shape)}; weight must be "
            "[V/tp, H] with the same H (pass the output layer's weight, not its transpose)"
        )
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden has dtype {hidden.dtype} but weight has {weight.dtype}; cast one to the other")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight on {weight.device}; move them to one device")
    if weight.shape[0] == 0:
        raise ValueError("weight has 0 vocabulary rows; every TP rank must hold a non-empty shard")


def check_targets(targets: object, num_tokens: int) -> torch.Tensor:
    """Checks ``targets`` is an integer [N] tensor; returns it as int64."""
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1 or targets.shape[0] != num_tokens:
        shape = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets has shape {shape}; it must be [N] with N={num_tokens} (hidden's rows)")
    if targets.is_floating_point() or targets.dtype == torch.bool or targets.is_complex():
        raise ValueError(f"targets has dtype {targets.dtype}; it must hold integer token ids; cast with .long()")
    return targets.long()


def check_target_range(valid_targets: torch.Tensor, vocab: int) -> None:
    """Checks every valid target id is in ``[0, vocab)`` (vocab = V/tp x tp)."""
    if valid_targets.numel() == 0:
        return
    low, high = int(valid_targets.min()), int(valid_targets.max())
    if low < 0 or high >= vocab:
        raise ValueError(
            f"targets of valid tokens span [{low}, {high}] but the vocabulary (V/tp x tp) has {vocab} ids; "
            "ids must be in [0, V): check the tokenizer/vocab padding, or mask those tokens out"
        )


def check_options(temperature: object, chunk_size: object, impl: object, tp_group: object) -> None:
    """Checks the scalar switches of the fused loss.

    Args:
        temperature: must be a finite number > 0.
        chunk_size: None (pick by memory) or an int >= 1.
        impl: one of ``IMPLS``.
        tp_group: None or a ``torch.distributed`` process group (initialised).

    Raises:
        ValueError: naming the first broken rule.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature={temperature!r} must be a number > 0 (the sampling temperature)")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature!r} must be finite")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r} must be None (pick by memory) or an int >= 1 (tokens per chunk)")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}; pick one of them")
    if tp_group is not None and not dist.is_initialized():
        raise ValueError(
            "tp_group was given but torch.distributed is not initialised; call init_process_group first "
            "or pass tp_group=None"
        )


def check_is_inputs(fleet_logp: Optional[torch.Tensor], tis_weights: Optional[torch.Tensor]) -> None:
    """Only one source of truncated-IS weights may be given."""
    if fleet_logp is not None and tis_weights is not None:
        raise ValueError(
            "pass either fleet_logp (weights computed here from params.tis_cap/tis_level) or tis_weights "
            "(precomputed), not both"
        )
