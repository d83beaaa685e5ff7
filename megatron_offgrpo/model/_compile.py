"""``model.compile``: torch.compile of each decoder layer of a stage (regional compilation).

Every decoder layer has the same code, so one compiled graph serves all of them: the first step compiles it (tens
of seconds), the others reuse it. Inductor fuses what the local spec runs as separate kernels (the RMSNorms, the
rotary embedding, SwiGLU's elementwise ops and their backwards), which is where a step without Transformer
Engine spends its launches. The layer's attention stays PyTorch's SDPA (FlashAttention on GPUs).

One graph break is removed first: megatron-core 0.16's ``RowParallelLinear.forward`` passes ``tp_group=None`` down,
and ``get_tensor_model_parallel_group_if_none`` then issues a DeprecationWarning on rank 0 at every call, which
dynamo cannot trace (it breaks each layer's graph in four). The replacement returns the same group, without the
warning; it is installed only when a stage is compiled.
"""

from __future__ import annotations

import torch

_PATCHED: list[bool] = []


def _quiet_group_if_none(tp_group, is_expert=False, check_initialized=True):
    """``megatron.core.utils.get_tensor_model_parallel_group_if_none`` without its warning."""
    from megatron.core import parallel_state

    if tp_group is not None or not torch.distributed.is_initialized() or not parallel_state.is_initialized():
        return tp_group if torch.distributed.is_initialized() else None
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def _install_quiet_group_lookup() -> None:
    from megatron.core.tensor_parallel import layers

    if not _PATCHED:
        layers.get_tensor_model_parallel_group_if_none = _quiet_group_if_none
        _PATCHED.append(True)


def compile_layers(stage: torch.nn.Module, mode: str = "default") -> int:
    """Compile every decoder layer of ``stage`` in place (``nn.Module.compile``; ``mode``: torch.compile's, e.g.
    "reduce-overhead" for CUDA graphs of the compiled layers); returns how many."""
    _install_quiet_group_lookup()
    layers = list(stage.decoder.layers) if hasattr(stage, "decoder") else []
    for layer in layers:
        layer.compile(mode=None if mode == "default" else mode)
    return len(layers)
