"""LoRA adapters for the export tests: the model room's (``model.lora``: under each adapted linear ``P`` a child
``P.lora`` with ``weight_a`` [r, in], ``weight_b`` [out, r], this TP rank's shards, and a float ``scaling``) holding
the test's own whole random factors, sharded (a column-parallel layer's B as its weight's rows, a row-parallel
layer's A as its weight's columns).

The oracle is megatron's own arithmetic on whole tensors: ``merged_hf`` adds ``s B A`` to each full megatron weight
and names the result through the base weight map alone, so the adapter mapping under test is not used to check
itself.
"""

from __future__ import annotations

import torch

from checkpoint_tools import adapters
from checkpoint_tools import _mapping as M

ALL = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ATTENTION = ("linear_qkv", "linear_proj")


def full_adapters(arch, card: adapters.LoraCard, seed: int = 0, dtype=torch.float32
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Random whole factors (A [r, in], B [out, r], both nonzero) of every adapted weight, by global megatron name
    of the base weight (local spelling)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = _megatron_shapes(arch)
    out = {}
    for layer in range(arch.num_layers):
        for target in card.targets:
            base = f"decoder.layers.{layer}.{adapters.TARGETS[target]}.weight"
            rows, cols = shapes[target]
            a = torch.randn(card.rank, cols, generator=gen, dtype=torch.float64) * 0.2
            b = torch.randn(rows, card.rank, generator=gen, dtype=torch.float64) * 0.2
            out[base] = (a.to(dtype), b.to(dtype))
    return out


def _megatron_shapes(arch) -> dict[str, tuple[int, int]]:
    h, d = arch.hidden_size, arch.head_dim
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d
    return {"linear_qkv": (qkv, h), "linear_proj": (h, arch.num_heads * d),
            "linear_fc1": (2 * arch.intermediate_size, h), "linear_fc2": (h, arch.intermediate_size)}


@torch.no_grad()
def attach(model: torch.nn.Module, card: adapters.LoraCard, fulls, tp: int = 1, tp_rank: int = 0,
           layer_offset: int = 0) -> None:
    """Give a stage (stage-local layers from global ``layer_offset``) the model room's adapters
    (``model.lora.attach_lora``: forward and checkpoint entries), then this rank's shards of ``fulls`` as their values
    (sharded as ``adapters.adapter_split`` says; a shape the model room disagrees with fails the copy)."""
    from megatron_offgrpo.model import lora

    lora.attach_lora(model, lora.LoraSpec(card.rank, card.alpha, card.dropout, card.targets))
    for index in range(len(model.decoder.layers)):
        for target in card.targets:
            path = f"decoder.layers.{index}.{adapters.TARGETS[target]}"
            a, b = fulls[f"decoder.layers.{index + layer_offset}.{adapters.TARGETS[target]}.weight"]
            adapter = model.get_submodule(f"{path}.lora")
            for factor, full in (("a", a), ("b", b)):
                shard = M.shard_for_tp(full, adapters.adapter_split(f"{path}.lora.weight_{factor}"), tp, tp_rank)
                param = getattr(adapter, f"weight_{factor}")
                assert param.shape == shard.shape, f"{path}.lora.weight_{factor}: {param.shape} != {shard.shape}"
                param.copy_(shard)


def merged_hf(hf_state: dict[str, torch.Tensor], arch, card: adapters.LoraCard, fulls) -> dict[str, torch.Tensor]:
    """The HF tensors of the base with each adapted weight ``W + s B A`` (in fp64, rounded once to W's dtype),
    merged in megatron's layout and named by the base weight map."""
    out = dict(hf_state)
    for base, (a, b) in fulls.items():
        weight = M.hf_to_megatron(base, arch, hf_state)
        merged = (weight.double() + card.scaling * (b.double() @ a.double())).to(weight.dtype)
        out.update(M.megatron_to_hf(base, merged, arch))
    return out


def peft_pairs(arch, fulls) -> list[tuple[str, torch.Tensor]]:
    """The PEFT tensors of whole factors, by the converter under test."""
    pairs = []
    for base, (a, b) in fulls.items():
        stem = base.removesuffix(".weight")
        pairs += adapters.adapter_to_peft(f"{stem}.lora.weight_a", a, arch)
        pairs += adapters.adapter_to_peft(f"{stem}.lora.weight_b", b, arch)
    return pairs
