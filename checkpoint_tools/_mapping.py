"""The one HF <-> megatron weight map for Qwen2/Qwen2.5/Qwen3 (the only place that knows these names).

Two levels, both declarative:
1. ``RULES``: each megatron parameter (TP-merged, "full") <-> one or more HF tensors, with a merge op:
   ``copy`` (same tensor), ``qkv`` (HF q/k/v -> megatron's per-group interleave ``[q_g.., k_g, v_g]`` for each of
   the ``num_kv_heads`` groups), ``gate_up`` (HF gate/up -> ``[gate; up]``).
2. ``TP_SPLITS``: how a full megatron tensor is sharded across TP ranks: ``replicated``, ``rows`` (dim 0),
   ``cols`` (dim 1), ``gate_up`` (each half chunked, rank r holds ``[gate_r; up_r]``: a plain chunk of
   ``[gate; up]`` is wrong). The qkv interleave is group-major, so its TP shard is a plain ``rows`` chunk.

Megatron names are those of the local spec. The Transformer Engine spec's (megatron-core's
``get_gpt_layer_with_transformer_engine_spec``) are accepted wherever a megatron name is read: the input norm fused
into ``linear_qkv`` and a dense layer's pre-MLP norm into ``linear_fc1`` as ``layer_norm_weight`` (``te_alias``; a
MoE layer keeps its own ``pre_mlp_layernorm``, a TE norm), grouped experts as ``linear_fc1.weight{j}``
(``expert_param``). Nothing here writes TE names: a state dict is written under the model's own keys
(``_state_dict.hf_to_state_dict``); ``tests/checkpoint/test_te_names.py`` checks the TE layout both ways.
Layer indices in megatron names are stage-local; ``to_global_layer`` converts.

Qwen3-MoE: every expert of a layer is one *stacked* megatron tensor, ``decoder.layers.{i}.mlp.experts.linear_fc1``
``[E, 2I, H]`` (each expert ``[gate_e; up_e]``) and ``linear_fc2`` ``[E, H, I]``, from HF's per-expert tensors
(``mlp.experts.{e}.gate_proj``...). Expert parallelism splits the stack along experts (EP rank r holds experts
``r*E/ep ..``), TP splits each expert as the dense MLP is split (``experts_gate_up``, ``experts_cols``). The model's own
parameters are one per local expert (``local_experts.{j}.linear_fc1.weight`` under the local spec, TE's grouped
``linear_fc1.weight{j}``); ``expert_param`` names their stack and place in it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import torch

from megatron_offgrpo.model import QwenArch

L = "{i}"  # layer index placeholder in patterns


@dataclasses.dataclass(frozen=True)
class Rule:
    """One megatron parameter and the HF tensors it is made of.

    Attributes:
        megatron: megatron name pattern (``{i}`` = layer index). hf: HF name patterns, in merge order.
        op: "copy" | "qkv" | "gate_up" | "experts_gate_up" | "experts" (the last two: one HF tensor set per expert,
            ``{e}`` in ``hf``). split: TP split kind. te_alias: the name under the TE spec, if different.
        when: "always" | "qkv_bias" | "qk_norm" | "untied" | "dense" | "moe" (rule applies only to archs with that
            feature).
        stage: "first" (embedding) | "last" (final norm, output layer) | "layer".
    """

    megatron: str
    hf: tuple[str, ...]
    op: str = "copy"
    split: str = "replicated"
    te_alias: str | None = None
    when: str = "always"
    stage: str = "layer"

    @property
    def per_expert(self) -> bool:
        """The megatron tensor stacks every expert of its layer (HF patterns hold ``{e}``)."""
        return self.op.startswith("experts")


_ATT = "decoder.layers.{i}.self_attention"
_HF_ATT = "model.layers.{i}.self_attn"
RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), split="rows", stage="first"),
    Rule(
        "decoder.layers.{i}.input_layernorm.weight",
        ("model.layers.{i}.input_layernorm.weight",),
        te_alias=f"{_ATT}.linear_qkv.layer_norm_weight",
    ),
    Rule(
        f"{_ATT}.linear_qkv.weight",
        (f"{_HF_ATT}.q_proj.weight", f"{_HF_ATT}.k_proj.weight", f"{_HF_ATT}.v_proj.weight"),
        op="qkv",
        split="rows",
    ),
    Rule(
        f"{_ATT}.linear_qkv.bias",
        (f"{_HF_ATT}.q_proj.bias", f"{_HF_ATT}.k_proj.bias", f"{_HF_ATT}.v_proj.bias"),
        op="qkv",
        split="rows",
        when="qkv_bias",
    ),
    Rule(f"{_ATT}.q_layernorm.weight", (f"{_HF_ATT}.q_norm.weight",), when="qk_norm"),
    Rule(f"{_ATT}.k_layernorm.weight", (f"{_HF_ATT}.k_norm.weight",), when="qk_norm"),
    Rule(f"{_ATT}.linear_proj.weight", (f"{_HF_ATT}.o_proj.weight",), split="cols"),
    Rule(
        "decoder.layers.{i}.pre_mlp_layernorm.weight",
        ("model.layers.{i}.post_attention_layernorm.weight",),
        te_alias="decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight",
    ),
    Rule(
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        op="gate_up",
        split="gate_up",
        when="dense",
    ),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",), split="cols",
         when="dense"),
    Rule("decoder.layers.{i}.mlp.router.weight", ("model.layers.{i}.mlp.gate.weight",), when="moe"),
    Rule(
        "decoder.layers.{i}.mlp.experts.linear_fc1.weight",
        ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight", "model.layers.{i}.mlp.experts.{e}.up_proj.weight"),
        op="experts_gate_up",
        split="experts_gate_up",
        when="moe",
    ),
    Rule("decoder.layers.{i}.mlp.experts.linear_fc2.weight", ("model.layers.{i}.mlp.experts.{e}.down_proj.weight",),
         op="experts", split="experts_cols", when="moe"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), stage="last"),
    Rule("output_layer.weight", ("lm_head.weight",), split="rows", when="untied", stage="last"),
)


class UnknownTensorError(ValueError):
    """A tensor name that no rule of the map knows."""


def _applies(rule: Rule, arch: QwenArch) -> bool:
    return {
        "always": True,
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "untied": not arch.tie_word_embeddings,
        "dense": not arch.is_moe,
        "moe": arch.is_moe,
    }[rule.when]


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(re.escape(L), r"(\d+)").replace(re.escape("{e}"), r"\d+") + "$")


def _hf_keys(rule: Rule, layer: int | None, arch: QwenArch, experts: range | None = None) -> list[str]:
    """The HF names of one megatron tensor, in merge order; per-expert rules: expert by expert over ``experts``
    (default all), each expert's tensors in ``rule.hf`` order."""
    filled = [p.replace(L, str(layer)) for p in rule.hf]
    if not rule.per_expert:
        return filled
    return [p.replace("{e}", str(e)) for e in (experts or range(arch.num_experts)) for p in filled]


_EXPERT_PARAM = (
    re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$"),  # local
    re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts)\.(linear_fc[12])\.weight(\d+)$"),  # TE grouped GEMM
)


def expert_param(name: str) -> tuple[str, int] | None:
    """(stacked megatron name, local expert index) of one expert's model parameter; None for other names."""
    match = _EXPERT_PARAM[0].match(name)
    if match:
        return f"{match.group(1)}.{match.group(3)}.weight", int(match.group(2))
    match = _EXPERT_PARAM[1].match(name)
    if match:
        return f"{match.group(1)}.{match.group(2)}.weight", int(match.group(3))
    return None


_MEGATRON_REGEX = [(r, _pattern_regex(r.megatron)) for r in RULES] + [
    (r, _pattern_regex(r.te_alias)) for r in RULES if r.te_alias
]
_HF_REGEX = [(r, k, _pattern_regex(p)) for r in RULES for k, p in enumerate(r.hf)]


def layers_of_stage(arch: QwenArch, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers held by pipeline stage ``pp_rank`` (even split)."""
    per_stage = arch.num_layers // pp
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def full_megatron_names(arch: QwenArch, pp: int = 1, pp_rank: int = 0) -> list[str]:
    """Megatron names (stage-local layer indices) held by one PP stage, in model order.

    With tied embeddings and pp > 1 the last stage also holds ``output_layer.weight`` (megatron keeps a copy
    there, synchronised with the embedding); it maps to the same HF tensor as the embedding.
    """
    first, last = pp_rank == 0, pp_rank == pp - 1
    names = []
    for rule in RULES:
        if rule.stage == "first" and first:
            names.append(rule.megatron)
    for local_i in range(len(layers_of_stage(arch, pp, pp_rank))):
        names.extend(r.megatron.format(i=local_i) for r in RULES if r.stage == "layer" and _applies(r, arch))
    if last:
        names.append("decoder.final_layernorm.weight")
        if not arch.tie_word_embeddings or pp > 1:
            names.append("output_layer.weight")
    return names


def rule_for_megatron(name: str) -> tuple[Rule, int | None]:
    """The rule and stage-local layer index of a megatron name (local or TE spelling).

    Raises:
        UnknownTensorError: naming the tensor when no rule matches.
    """
    for rule, regex in _MEGATRON_REGEX:
        match = regex.match(name)
        if match:
            return rule, int(match.group(1)) if match.groups() else None
    raise UnknownTensorError(f"unknown megatron tensor {name!r}: not in checkpoint_tools' Qwen weight map")


def hf_names(arch: QwenArch) -> list[str]:
    """Every HF tensor name of the model, in the order ``megatron_to_hf_tensors`` yields them."""
    out = []
    for name in full_megatron_names(arch):
        rule, layer = rule_for_megatron(name)
        out.extend(_hf_keys(rule, layer, arch))
    return out


def to_global_layer(name: str, offset: int) -> str:
    """Shift the layer index of a megatron name by ``offset`` (stage-local <-> global)."""
    return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def megatron_to_hf(
    name: str, full: torch.Tensor, arch: QwenArch, layer_offset: int = 0
) -> list[tuple[str, torch.Tensor]]:
    """Convert one TP-merged megatron tensor into its HF tensor(s).

    Args:
        name: megatron name with a stage-local layer index. full: the TP-merged tensor.
        layer_offset: first global layer of the stage.
    """
    rule, layer = rule_for_megatron(name)
    hf = _hf_keys(rule, None if layer is None else layer + layer_offset, arch)
    if rule.op == "experts_gate_up":  # [E, 2I, H] -> gate_e, up_e per expert
        halves = full.chunk(2, dim=1)
        return [(n, halves[k % 2][k // 2]) for k, n in enumerate(hf)]
    if rule.op == "experts":
        return list(zip(hf, full.unbind(0)))
    if rule.op == "copy":
        if rule.megatron == "output_layer.weight" and arch.tie_word_embeddings:
            return []  # tied: the embedding already carries this tensor
        return [(hf[0], full)]
    if rule.op == "gate_up":
        gate, up = full.chunk(2, dim=0)
        return [(hf[0], gate), (hf[1], up)]
    q, k, v = _split_qkv(full, arch)
    return [(hf[0], q), (hf[1], k), (hf[2], v)]


def _split_qkv(full: torch.Tensor, arch: QwenArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron ``[ng * (hpg + 2) * d, ...]`` group-interleaved -> HF q ``[nh*d, ...]``, k, v ``[ng*d, ...]``."""
    ng, hpg, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    grouped = full.reshape(ng, (hpg + 2) * d, *full.shape[1:])
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    tail = full.shape[1:]
    return q.reshape(ng * hpg * d, *tail), k.reshape(ng * d, *tail), v.reshape(ng * d, *tail)


def _merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: QwenArch) -> torch.Tensor:
    ng, hpg, d = arch.num_kv_heads, arch.heads_per_group, arch.head_dim
    tail = q.shape[1:]
    grouped = torch.cat(
        [q.reshape(ng, hpg * d, *tail), k.reshape(ng, d, *tail), v.reshape(ng, d, *tail)], dim=1
    )
    return grouped.reshape(ng * (hpg + 2) * d, *tail)


def hf_sources(name: str, arch: QwenArch, layer_offset: int = 0,
               experts: range | None = None) -> tuple[Rule, list[str]]:
    """The rule and the HF tensor names a megatron tensor (stage-local layer index) is built from (per-expert
    rules: of ``experts``, default all)."""
    rule, layer = rule_for_megatron(name)
    if rule.megatron == "output_layer.weight" and arch.tie_word_embeddings:
        rule = RULES[0]  # tied embeddings: the last stage's copy of the output layer is the embedding
    return rule, _hf_keys(rule, None if layer is None else layer + layer_offset, arch, experts)


def hf_to_megatron(name: str, arch: QwenArch, hf_tensors, layer_offset: int = 0,
                   experts: range | None = None) -> torch.Tensor:
    """Build the TP-merged megatron tensor ``name`` (stage-local layer index) from HF tensors.

    Args:
        hf_tensors: a mapping (``in`` and ``[]``) from HF names to tensors; read lazily, one tensor at a time.
        experts: for a stacked expert tensor, the experts to stack (an EP rank's: ``experts_of_rank``); default all.

    Raises:
        KeyError: naming the missing HF tensor.
    """
    rule, keys = hf_sources(name, arch, layer_offset, experts)
    sources = []
    for key in keys:
        if key not in hf_tensors:
            raise KeyError(f"HF tensor {key!r} (needed for megatron {name!r}) is missing from the checkpoint")
        sources.append(hf_tensors[key])
    if rule.op == "copy":
        return sources[0]
    if rule.op == "gate_up":
        return torch.cat(sources, dim=0)
    if rule.op == "experts_gate_up":
        return torch.stack([torch.cat(sources[k:k + 2], dim=0) for k in range(0, len(sources), 2)])
    if rule.op == "experts":
        return torch.stack(sources)
    return _merge_qkv(*sources, arch)


def experts_of_rank(arch: QwenArch, ep: int, ep_rank: int) -> range:
    """Global indices of the experts EP rank ``ep_rank`` holds (megatron: contiguous, rank-major)."""
    per_rank = arch.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def megatron_global_name_for_hf(hf_name: str) -> str:
    """The global megatron name an HF tensor feeds (e.g. q_proj of layer 3 -> layer 3's linear_qkv)."""
    pattern, layer = megatron_name_for_hf(hf_name)
    return pattern.format(i=layer)


def split_kind(name: str) -> str:
    """TP split kind of a megatron tensor."""
    return rule_for_megatron(name)[0].split


def split_dim(kind: str) -> tuple[str, int]:
    """(dense split kind, first dim it acts on): stacked expert tensors split each expert as the dense MLP does."""
    return {"experts_gate_up": ("gate_up", 1), "experts_cols": ("cols", 1)}.get(kind, (kind, 0))


def is_expert_kind(kind: str) -> bool:
    """The split kind of a stacked expert tensor (dim 0: experts, split over EP)."""
    return kind.startswith("experts")


def shard_for_tp(full: torch.Tensor, kind: str, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of a full megatron tensor (contiguous: gloo sends wrong bytes from views)."""
    base, dim = split_dim(kind)
    if base == "replicated" or tp == 1:
        return full.contiguous()
    if base in ("rows", "cols"):
        return full.chunk(tp, dim=dim + (base == "cols"))[tp_rank].contiguous()
    gate, up = full.chunk(2, dim=dim)
    return torch.cat([gate.chunk(tp, dim=dim)[tp_rank], up.chunk(tp, dim=dim)[tp_rank]], dim=dim)


def merge_tp(shards: list[torch.Tensor], kind: str) -> torch.Tensor:
    """Inverse of ``shard_for_tp``: the full tensor from all TP ranks' shards (in rank order)."""
    base, dim = split_dim(kind)
    if base == "replicated" or len(shards) == 1:
        return shards[0]
    if base in ("rows", "cols"):
        return torch.cat(shards, dim=dim + (base == "cols"))
    halves = [s.chunk(2, dim=dim) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)


def megatron_name_for_hf(hf_name: str) -> tuple[str, int | None]:
    """The megatron name pattern (with ``{i}``) and global layer index a HF tensor feeds.

    Raises:
        UnknownTensorError: naming the tensor when no rule matches.
    """
    for rule, _, regex in _HF_REGEX:
        match = regex.match(hf_name)
        if match:
            return rule.megatron, int(match.group(1)) if match.groups() else None
    raise UnknownTensorError(f"unknown HF tensor {hf_name!r}: not part of a Qwen2/Qwen3 causal LM")


def check_hf_names(names: Iterable[str], arch: QwenArch) -> None:
    """Raise when HF names are missing from, or unknown to, the model of ``arch``.

    ``lm_head.weight`` next to tied embeddings is tolerated (some exporters write it).
    """
    expected = set(hf_names(arch))
    present = set(names)
    unknown = sorted(n for n in present - expected if not (n == "lm_head.weight" and arch.tie_word_embeddings))
    missing = sorted(expected - present)
    for name in unknown:
        megatron_name_for_hf(name)  # raises UnknownTensorError with the name when it is not a Qwen tensor
    if missing or unknown:
        raise KeyError(f"HF checkpoint does not match the config: missing {missing[:5]}, unexpected {unknown[:5]}")


def local_name(name: str) -> str:
    """The local-spec spelling of a megatron name given in either spelling."""
    rule, layer = rule_for_megatron(name)
    return rule.megatron.format(i=layer)
