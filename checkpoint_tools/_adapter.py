"""LoRA adapters across the HF <-> megatron wall: megatron's adapter factors -> PEFT's, the merge into the base, the
adapter's description (``LoraCard``) and the PEFT directory writer.

The megatron side (``model.lora``): each adapted linear ``P`` (``decoder.layers.{i}.self_attention.linear_qkv``,
``.linear_proj``, ``decoder.layers.{i}.mlp.linear_fc1``, ``.linear_fc2``; ``i`` stage-local) has a child ``P.lora``
with ``weight_a`` = A [r, in] and ``weight_b`` = B [out, r]; the layer computes ``(W + s B A) x``, ``s = alpha / r``.
Under TP each factor is split as the base weight is on the side it shares with it: a column-parallel layer's B by
the base weight's rows (its split kind: ``rows`` for qkv, ``gate_up`` for fc1), a row-parallel layer's A by its
columns (``cols``); the other factor is on every rank (``adapter_split``).

The PEFT side: ``base_model.model.<HF module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r]. A megatron
linear fused from several HF ones (qkv from q/k/v, fc1 from gate/up) becomes one PEFT adapter per HF module, all with
the same A, and B split exactly as the base weight is (``_mapping.megatron_to_hf`` applied to B, whose rows are the
base weight's rows). This is exact: the q rows of ``W_qkv + s B A`` are ``W_q + s B_q A``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import torch

from checkpoint_tools import _mapping as M
from checkpoint_tools._io import atomic_output_dir, tensor_record, write_manifest
from checkpoint_tools._safetensors_stream import StreamingSafetensorsWriter
from checkpoint_tools._shapes import hf_shapes
from megatron_offgrpo.model import QwenArch

ADAPTER = "lora"
"""The adapter's child module under an adapted linear: parameters ``<linear>.lora.weight_a`` / ``.weight_b``."""
TARGETS: dict[str, str] = {  # the adaptable linears: target name -> its path under a decoder layer
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
}
AdapterExport = Literal["merge", "only"]
"""What an export does with a model's LoRA adapters: ``merge`` them into the HF weights (``W + s B A``; a model
without adapters exports its weights as they are), or export ``only`` the adapters, PEFT-named."""
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the HF model: the prefix of PEFT's saved keys
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_NAME = re.compile(r"^(decoder\.layers\.(\d+)\.(" + "|".join(map(re.escape, TARGETS.values())) + r"))"
                   rf"\.{ADAPTER}\.weight_([ab])$")


@dataclasses.dataclass(frozen=True)
class LoraCard:
    """The adapters of a model, as its checkpoints and exports describe them (flat, JSON-able).

    Attributes:
        rank: r. alpha: PEFT's ``lora_alpha`` (the update is scaled by ``alpha / rank``).
        targets: the adapted linears, megatron names in ``TARGETS`` order (``linear_qkv``, ...).
        dropout: the adapter's input dropout while training (PEFT's ``lora_dropout``; 0 at inference either way).
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        """s in ``W + s B A``."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the dist checkpoint's model card holds it under ``lora``)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "dropout": self.dropout}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> LoraCard:
        """Inverse of ``to_dict``. Raises: ValueError naming the field that is missing or out of range."""
        try:
            card = cls(int(body["rank"]), float(body["alpha"]), tuple(body["targets"]), float(body.get("dropout", 0)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"lora card {body!r}: {type(exc).__name__}: {exc}") from None
        if card.rank < 1 or not card.targets or any(t not in TARGETS for t in card.targets):
            raise ValueError(f"lora card {body!r}: rank must be >= 1 and targets a non-empty subset of "
                             f"{list(TARGETS)}")
        return card


def is_adapter(name: str) -> bool:
    """A parameter name of an adapter factor (``...<linear>.lora.weight_a``), whatever linear it sits on."""
    return f".{ADAPTER}.weight_" in name


def parse_adapter(name: str) -> tuple[str, str, str]:
    """(the adapted base weight's megatron name, its target, "a" or "b") of an adapter parameter name.

    Raises:
        UnknownTensorError: naming the parameter when it is not a factor of an adaptable linear.
    """
    match = _NAME.match(name)
    if not match:
        raise M.UnknownTensorError(f"unknown adapter parameter {name!r}: LoRA factors sit on "
                                   f"decoder.layers.{{i}}.{{{','.join(TARGETS.values())}}}.{ADAPTER}.weight_a|b")
    target = match.group(3).rsplit(".", 1)[-1]
    return f"{match.group(1)}.weight", target, match.group(4)


def adapter_split(name: str) -> str:
    """The TP split kind of an adapter factor (``_mapping`` kinds): a column-parallel layer's B and a row-parallel
    layer's A split as the base weight, the other factor ``replicated``."""
    base, _, factor = parse_adapter(name)
    kind = M.split_kind(base)
    column = kind != "cols"  # qkv "rows", fc1 "gate_up": the output is split
    return kind if (factor == "b") == column else "replicated"


def _check_adaptable(base: str, arch: QwenArch) -> None:
    rule, _ = M.rule_for_megatron(base)
    if not M._applies(rule, arch):  # a dense MLP name on a MoE model: its MLP is the experts
        raise M.UnknownTensorError(f"adapter on {base!r}: a {arch.hf_architecture} layer has no such linear (its "
                                   "MLP is its experts; adapt the attention)")
    return rule


def adapter_to_peft(name: str, full: torch.Tensor, arch: QwenArch, layer_offset: int = 0
                    ) -> list[tuple[str, torch.Tensor]]:
    """One TP-gathered adapter factor (stage-local layer index) -> its PEFT (name, tensor) pairs.

    A of a fused linear is A of each of its HF modules; B is split as the base weight is (q/k/v de-interleaved,
    gate/up halved). Global layer index = stage-local + ``layer_offset``.

    Raises:
        UnknownTensorError: naming a parameter that is not an adapter factor this arch has.
    """
    base, _, factor = parse_adapter(name)
    _check_adaptable(base, arch)
    if factor == "b":
        pieces = M.megatron_to_hf(base, full, arch, layer_offset)
    else:
        pieces = [(hf_name, full) for hf_name in M.hf_sources(base, arch, layer_offset)[1]]
    suffix = ".lora_B.weight" if factor == "b" else ".lora_A.weight"
    return [(PEFT_PREFIX + hf_name.removesuffix(".weight") + suffix, tensor) for hf_name, tensor in pieces]


def merge_shard(weight: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor, scaling: float,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W + s B A`` of one TP shard, computed in (at least) fp32 and rounded once to ``dtype`` (default W's).

    A shard merges alone: a column-parallel layer's ``W_l + s B_l A`` is its rows of the full merge, a row-parallel
    layer's ``W_l + s B A_l`` its columns; the merged shard is then gathered as the base weight would be.
    """
    compute = torch.promote_types(weight.dtype, torch.float32)
    delta = weight_b.detach().to(compute) @ weight_a.detach().to(compute)
    return (weight.detach().to(compute) + scaling * delta).to(dtype or weight.dtype)


def _adapted_bases(card: LoraCard, arch: QwenArch) -> list[str]:
    """The adapted base weights' megatron names (global layers), in model order."""
    return [f"decoder.layers.{i}.{TARGETS[t]}.weight" for i in range(arch.num_layers) for t in card.targets]


def peft_shapes(card: LoraCard, arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Every PEFT tensor of the adapter -> its shape, in the order the PEFT file holds them (layer by layer, target
    by target, each HF module's ``lora_A`` then ``lora_B``); known before any data is read.

    Raises:
        UnknownTensorError: a target this arch lacks (a MoE arch's MLP).
    """
    base_shapes = hf_shapes(arch)
    shapes: dict[str, tuple[int, ...]] = {}
    for base in _adapted_bases(card, arch):
        _check_adaptable(base, arch)
        for hf_name in M.hf_sources(base, arch)[1]:
            out_dim, in_dim = base_shapes[hf_name]
            stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
            shapes[f"{stem}.lora_A.weight"] = (card.rank, in_dim)
            shapes[f"{stem}.lora_B.weight"] = (out_dim, card.rank)
    return shapes


def peft_target_modules(card: LoraCard, arch: QwenArch) -> list[str]:
    """PEFT's ``target_modules``: the HF module names the targets cover (linear_qkv -> q_proj, k_proj, v_proj)."""
    names = []
    for target in card.targets:
        base = f"decoder.layers.0.{TARGETS[target]}.weight"
        _check_adaptable(base, arch)
        names.extend(hf_name.split(".")[-2] for hf_name in M.hf_sources(base, arch)[1])
    return names


def hf_target_modules(arch: QwenArch, targets: Sequence[str] | None) -> tuple[str, ...]:
    """The HF modules (q_proj, ...) that the run's ``lora.targets`` (megatron's linears; None: the arch's default,
    ``model.lora.lora_spec``) adapt: what an engine serving the adapter is started with.

    Raises:
        ValueError: a target the arch cannot take (one line: MLP targets of a mixture of experts).
    """
    from megatron_offgrpo.model import lora

    spec = lora.lora_spec(arch, 1, 1.0, 0.0, list(targets) if targets is not None else None, 0)
    return tuple(peft_target_modules(LoraCard(spec.rank, spec.alpha, spec.targets), arch))


def peft_lora_config(rank: int, alpha: float, target_modules: Sequence[str], dropout: float = 0.0,
                     base_model: str | None = None) -> dict[str, Any]:
    """PEFT's LoRA ``adapter_config.json`` fields (what ``LoraConfig.to_dict`` writes, without the options these
    adapters never use): the one place they are written, for exports and for the engines' adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "revision": None,
        "inference_mode": True, "r": rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout, "target_modules": list(target_modules), "fan_in_fan_out": False, "bias": "none",
        "use_rslora": False, "use_dora": False, "lora_bias": False, "modules_to_save": None,
        "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {},
    }


def peft_config(card: LoraCard, arch: QwenArch, base_model: str | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of the adapter of ``card`` on ``arch``."""
    return peft_lora_config(card.rank, card.alpha, peft_target_modules(card, arch), card.dropout, base_model)


def write_peft(out: str | Path, card: LoraCard, arch: QwenArch, tensors: Iterable[tuple[str, torch.Tensor]],
               base_model: str | None = None, overwrite: bool = False) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``, a manifest) at ``out``,
    atomically: ``PeftModel.from_pretrained(base, out)`` loads it.

    Args:
        tensors: PEFT (name, tensor) pairs (``adapter_to_peft``'s), any order; every tensor ``peft_shapes`` names,
            each once. base_model: written as ``base_model_name_or_path``.

    Raises:
        ValueError: naming tensors missing, unexpected, repeated or of the wrong shape; nothing is written.
        FileExistsError: ``out`` exists and ``overwrite`` is False.
    """
    shapes = peft_shapes(card, arch)
    got: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name in got or name not in shapes or tuple(tensor.shape) != shapes[name]:
            why = "repeated" if name in got else "unexpected" if name not in shapes else (
                f"shape {tuple(tensor.shape)} != {shapes[name]}")
            raise ValueError(f"PEFT adapter tensor {name!r}: {why} (rank {card.rank}, targets {list(card.targets)})")
        got[name] = tensor
    if missing := [name for name in shapes if name not in got]:
        raise ValueError(f"PEFT adapter lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)} "
                         f"of {len(shapes)} tensors)")
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        writer = StreamingSafetensorsWriter(tmp / PEFT_WEIGHTS, [(n, got[n].dtype, s) for n, s in shapes.items()])
        for name in shapes:
            writer.write(name, got[name])
        writer.close()
        (tmp / PEFT_CONFIG).write_text(json.dumps(peft_config(card, arch, base_model), indent=2))
        write_manifest(tmp, "peft", {n: tensor_record(t, PEFT_WEIGHTS) for n, t in got.items()},
                       {"architecture": arch.hf_architecture, "lora": card.to_dict()})
    return Path(out)


def card_of_model(model: torch.nn.Module) -> LoraCard | None:
    """The ``LoraCard`` of a live model stage from its adapter modules (``lora`` children with ``weight_a``,
    ``weight_b`` and a float ``alpha``); None without adapters.

    Raises:
        ValueError: adapters of different ranks or scalings (one card describes one rank and alpha).
    """
    adapters = [(name, module) for name, module in model.named_modules()
                if name.endswith(f".{ADAPTER}") and hasattr(module, "weight_a")]
    if not adapters:
        return None
    shapes = {(int(m.weight_a.shape[0]), float(m.alpha)) for _, m in adapters}
    if len(shapes) > 1:
        raise ValueError(f"adapters of several (rank, alpha): {sorted(shapes)}; one card describes one of each")
    (rank, alpha), = shapes
    targets = {parse_adapter(f"{name}.weight_a")[1] for name, _ in adapters}
    dropout = getattr(getattr(adapters[0][1], "dropout", None), "p", 0.0)  # an nn.Identity: no dropout
    return LoraCard(rank, alpha, tuple(t for t in TARGETS if t in targets), float(dropout))
