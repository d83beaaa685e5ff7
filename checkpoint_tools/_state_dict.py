"""Megatron state dicts (``model.state_dict()`` of each rank of a stage) <-> HF tensors, in one process.

What ``load_hf_into_stage`` / ``stream_hf_buckets`` do for a live model, for its state dicts: a ``torch.save``d megatron
checkpoint, or a model of either layer spec whose ranks are not all in this process. Keys are taken as the model
spells them (local or TE spec, ``_mapping``); ``_extra_state`` entries carry no weight and are skipped on the way to
HF (``_live.is_extra_state``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping, Sequence

import torch

from checkpoint_tools import _mapping as M
from checkpoint_tools._live import _by_canonical_name, _hf_shards, is_extra_state
from megatron_offgrpo.model import QwenArch


def _no_fp8_state() -> torch.Tensor:
    """The extra state that means "no FP8 metadata": what TE's ``get_extra_state`` returns without FP8 (module/base.py,
    ``torch.empty(0, dtype=torch.uint8)``) and its ``set_extra_state`` returns early on (``numel() == 0``)."""
    return torch.empty(0, dtype=torch.uint8)


def hf_to_state_dict(
    hf_tensors: Mapping[str, torch.Tensor], arch: QwenArch, keys: Iterable[str], tp: int = 1, tp_rank: int = 0,
    pp: int = 1, pp_rank: int = 0, ep: int = 1, ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """One rank's state dict of a model stage from HF tensors, under the model's own ``keys`` (its
    ``state_dict().keys()``, in either spec's spelling), ready for ``model.load_state_dict``.

    ``_extra_state`` keys get the no-FP8 value, and only those among ``keys``: a TE model needs them. Megatron loads a
    state dict with ``load_state_dict``'s strict default (``_dist._load_model``, ``train/_checkpoint.py``), where
    torch's ``Module._load_from_state_dict`` counts an absent ``_extra_state`` as missing for every module that defines
    ``set_extra_state``, and strict loading raises on it. Megatron's own linears default theirs in a load pre-hook
    (tensor_parallel/layers.py, "Hook adding a default empty _extra_state"); TE's linears and norms have no such hook
    (TE module/base.py and ops/op.py ``_load_from_state_dict`` only read it first), only its ``DotProductAttention``
    forgives its own. A key the model lacks would be unexpected, so none is added. The no-FP8 value keeps what the
    module holds: TE's ``set_extra_state`` returns on an empty tensor, ``TEGroupedLinear``'s pre-hook returns without
    ``_extra_state1`` (megatron extensions/transformer_engine.py ``merge_extra_states``), megatron's linears ignore it.
    Experts are split over ``tp`` like the rest (expert TP = TP).

    Raises:
        KeyError: naming a missing HF tensor. UnknownTensorError: naming a key the weight map does not know.
    """
    keys = list(keys)
    out = {key: _no_fp8_state() for key in keys if is_extra_state(key)}
    grouped = _by_canonical_name(((k, k) for k in keys), arch, pp, pp_rank)
    for _, names, pieces in _hf_shards(grouped, arch, hf_tensors, tp, tp_rank, pp, pp_rank, ep, ep_rank, None, None):
        out.update(zip(names, (piece.contiguous() for piece in pieces)))
    return {key: out[key] for key in keys}


def state_dicts_to_hf(
    states: Sequence[Sequence[Mapping[str, torch.Tensor | None]]], arch: QwenArch, pp: int = 1, pp_rank: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of one PP stage from all its ranks' state dicts, ``states[ep_rank][tp_rank]``, in
    ``hf_names`` order (global layer indices). Dense tensors are read from EP rank 0; experts are TP-merged, then
    their EP ranks' stacks concatenated (expert TP = TP). ``_extra_state`` entries are skipped.

    Raises:
        UnknownTensorError: naming a key the weight map does not know.
    """
    grouped = [[dict(_by_canonical_name(sd.items(), arch, pp, pp_rank)) for sd in by_tp] for by_tp in states]
    offset = M.layers_of_stage(arch, pp, pp_rank).start
    for name in grouped[0][0]:
        kind = M.split_kind(name)
        if M.is_expert_kind(kind):
            full = torch.cat([M.merge_tp([torch.stack(rank[name]) for rank in by_tp], kind) for by_tp in grouped])
        else:
            full = M.merge_tp([rank[name][0] for rank in grouped[0]], kind)
        yield from M.megatron_to_hf(name, full, arch, layer_offset=offset)
