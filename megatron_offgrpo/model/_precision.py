"""``model.precision`` -> the megatron ``TransformerConfig`` of a trained policy: the params' dtype and FP8.

fp32 and bf16 are the params' dtype; fp8 keeps bf16 params and runs the linears' GEMMs in FP8 through Transformer
Engine (megatron's ``fp8="hybrid"``: E4M3 forward, E5M2 gradients), so it is refused where TE is not usable.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

from megatron_offgrpo.model._arch import QwenArch
from megatron_offgrpo.model._builder import transformer_config
from megatron_offgrpo.runtime import have_te

PARAMS_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.bfloat16}


def params_dtype(precision: str) -> torch.dtype:
    """The dtype the weights of a ``model.precision`` policy are held in (fp8: bf16 weights, FP8 GEMMs)."""
    return PARAMS_DTYPES[precision]


def precision_transformer_config(arch: QwenArch, tp: int, pp: int, precision: str, fp8_recipe: str = "delayed",
                                 fp8_amax_history: int = 1024, fp8_margin: int = 0, ep: int = 1,
                                 moe_aux_loss_coef: float | None = None,
                                 routing_replay: bool = False, etp: int | None = None,
                                 sequence_parallel: bool | None = None) -> TransformerConfig:
    """``transformer_config`` for a policy trained in ``precision`` (``model.precision``, ``model.fp8_*``), with
    ``ep``, ``etp``, ``moe_aux_loss_coef`` and ``routing_replay`` for MoE archs and ``sequence_parallel``
    (``parallel.sequence_parallel``).

    Raises:
        ValueError: fp8 where Transformer Engine is not usable (the message says why and what to use).
    """
    if precision == "fp8" and not have_te():
        from megatron_offgrpo.runtime import te_status

        raise ValueError(f"model.precision='fp8' needs Transformer Engine, but {te_status()[1]}: use bf16 or fp32")
    config = transformer_config(arch, tp, pp, params_dtype=params_dtype(precision), ep=ep,
                                moe_aux_loss_coef=moe_aux_loss_coef, routing_replay=routing_replay, etp=etp,
                                sequence_parallel=sequence_parallel)
    if precision == "fp8":
        config.fp8 = "hybrid"
        config.fp8_recipe = fp8_recipe
        config.fp8_amax_history_len = fp8_amax_history
        config.fp8_margin = fp8_margin
        # TE's FP8 grouped GEMM needs each expert's token count a multiple of 16: the router pads its map with
        # zero-probability slots (megatron's option for this) instead of the experts padding their inputs
        config.moe_router_padding_for_quantization = arch.is_moe
    return config
