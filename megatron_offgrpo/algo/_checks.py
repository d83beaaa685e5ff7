"""Input checks shared by the per-token functions: shapes and dtypes only (no values, so no host sync).

Shape notation: N = tokens flattened over the packed batch.
"""

from __future__ import annotations

from typing import Optional

import torch


def check_1d(name: str, tensor: object, n: Optional[int] = None) -> torch.Tensor:
    """Checks that ``tensor`` is a 1-D tensor, of length ``n`` when given.

    Args:
        name: the argument's name, for the message.
        tensor: the value to check.
        n: the required length, or None.

    Returns:
        ``tensor`` unchanged.

    Raises:
        ValueError: if it is not a tensor, not 1-D, or of the wrong length.
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}; pass a tensor")
    if tensor.dim() != 1:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must be 1-D [N]; flatten it first")
    if n is not None and tensor.shape[0] != n:
        raise ValueError(
            f"{name} has {tensor.shape[0]} entries but the token axis (loss_mask) has N={n}; "
            "all per-token tensors must have the same length N"
        )
    return tensor


def check_per_token(loss_mask: object, **tensors: Optional[torch.Tensor]) -> int:
    """Checks a bool ``[N]`` mask and floating ``[N]`` tensors of the same length (None entries are skipped).

    Args:
        loss_mask: [N] bool, True = the token is a response token that enters the loss.
        **tensors: name -> [N] floating tensor, or None when optional and absent.

    Returns:
        N.

    Raises:
        ValueError: naming the first argument with a wrong type, dtype, rank or length.
    """
    mask = check_1d("loss_mask", loss_mask)
    if mask.dtype != torch.bool:
        raise ValueError(
            f"loss_mask has dtype {mask.dtype}; it must be torch.bool (True = token enters the loss); "
            "convert with mask.bool() or mask != 0"
        )
    n = mask.shape[0]
    for name, tensor in tensors.items():
        if tensor is None:
            continue
        check_1d(name, tensor, n)
        if not tensor.is_floating_point():
            raise ValueError(f"{name} has dtype {tensor.dtype}; it must be a floating tensor; cast with .float()")
    return n
