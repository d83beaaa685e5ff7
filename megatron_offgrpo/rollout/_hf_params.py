"""Where a checkpoint-format HF tensor goes in a loaded ``transformers`` model.

Checkpoints and refreshes name a Qwen3-MoE expert's weights one expert at a time
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), but transformers >= 5 holds a layer's experts fused:
``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
``[E, H, I]``; ``from_pretrained`` converts on load, an in-place refresh must do the same. Older transformers keep one
module per expert, whose parameters carry the checkpoint names themselves.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def parameter_view(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The parameter (or the slice of a fused expert parameter) a checkpoint tensor ``name`` is copied into.

    Raises:
        KeyError: naming the tensor when the model has no place for it.
    """
    if name in params:
        return params[name]
    match = _EXPERT.match(name)
    if match is None:
        raise KeyError(f"HF tensor {name!r} has no parameter in the served model")
    prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
    if kind == "down":
        return params[f"{prefix}.down_proj"][expert]
    gate_up = params[f"{prefix}.gate_up_proj"][expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if kind == "gate" else gate_up[half:]
