"""Adapter payloads: the second kind of weights a refresh carries, a LoRA adapter's tensors and its shape.

With ``lora.sync=adapter`` the trainer sends, every v steps, only the low-rank A/B matrices of the policy's adapter.
They travel in buckets through whichever transport carries full refreshes (disk, collective, shm, in memory), named
exactly as PEFT's ``save_pretrained`` writes them::

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight    [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight    [out, r]

and the worker builds vLLM's adapter from them (``fleet._lora_swap``). ``AdapterSpec`` is what both sides must agree
on (rank, alpha, the HF modules adapted): the engine starts with it (vLLM's LoRA enabled, an all-zero adapter of that
shape as version 0: PEFT starts B at zero, so the policy at step 0 is the base) and every install names it. The
scaling is PEFT's default ``alpha / rank`` (no rsLoRA).

Every request of an engine serving an adapter runs under one fixed LoRA slot (``SLOT_ID``, vLLM's ``lora_int_id``,
and ``LORA_NAME``; the engine holds one adapter, ``max_loras = max_cpu_loras = 1``): a refresh replaces that slot's
weights in place while the engine is paused, exactly as a full refresh replaces the base weights, so requests in
flight and per-token versions need nothing new.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import torch

from checkpoint_tools import Named, expected_hf_shapes, files
from checkpoint_tools import adapters as ckpt_adapters

if TYPE_CHECKING:  # the worker calls import this module, and the protocol imports them
    from megatron_offgrpo.transports._protocol import Buckets

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF modules an adapter may target: the attention projections and the dense MLP's."""

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a base model's module names in an adapter's tensor names."""

SLOT_ID = 1
"""The LoRA id (vLLM's ``lora_int_id``) every request of an engine serving the policy's adapter uses."""

LORA_NAME = "policy-lora"
"""The adapter's name: vLLM's ``lora_name``, and the model name a fleet server's requests give to be served with it."""

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""

_LAYER_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.weight$")


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """The shape of the policy's LoRA adapter.

    Attributes:
        rank: r, the inner dimension of every A [r, in] and B [out, r].
        alpha: PEFT's ``lora_alpha``; the update is ``(alpha / rank) * B @ A``.
        target_modules: the HF modules adapted, among ``TARGETS``, in every decoder layer.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))  # a JSON list comes back as a tuple
        unknown = [t for t in self.target_modules if t not in TARGETS]
        problems = []
        if not (isinstance(self.rank, int) and self.rank >= 1):
            problems.append(f"rank={self.rank!r} must be an integer >= 1")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            problems.append(f"alpha={self.alpha!r} must be a finite number > 0")
        if not self.target_modules or unknown or len(set(self.target_modules)) != len(self.target_modules):
            problems.append(f"target_modules={list(self.target_modules)} must be distinct names among {list(TARGETS)}")
        if problems:
            raise ValueError("AdapterSpec: " + "; ".join(problems))

    @property
    def scaling(self) -> float:
        """PEFT's default scale of ``B @ A``: alpha / rank."""
        return self.alpha / self.rank

    def peft_config(self, base_model: str | None = None) -> dict[str, Any]:
        """The adapter's ``adapter_config.json`` (what PEFT and vLLM read), for the base at ``base_model``."""
        return ckpt_adapters.peft_lora_config(self.rank, self.alpha, sorted(self.target_modules),
                                              base_model=base_model)

    def expected_shapes(self, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Every tensor name of this adapter on the model of ``hf_config`` -> its shape (PEFT names).

        Raises:
            ValueError: a target module that no decoder layer of the model has (e.g. ``gate_proj`` of a MoE model,
                whose MLPs are experts).
        """
        shapes: dict[str, tuple[int, ...]] = {}
        found = set()
        for name, shape in expected_hf_shapes(hf_config).items():
            match = _LAYER_LINEAR.match(name)
            if match is None or match.group(2) not in self.target_modules:
                continue
            found.add(match.group(2))
            stem = PEFT_PREFIX + name.removesuffix(".weight")
            out_features, in_features = shape
            shapes[f"{stem}.lora_A.weight"] = (self.rank, in_features)
            shapes[f"{stem}.lora_B.weight"] = (out_features, self.rank)
        missing = sorted(set(self.target_modules) - found)
        if missing:
            raise ValueError(f"adapter target_modules {missing}: no decoder layer of this model has them (a MoE "
                             "model's MLPs are experts: adapt its attention projections)")
        return shapes

    def vllm_max_rank(self) -> int:
        """The smallest ``max_lora_rank`` vLLM accepts that holds this rank."""
        fits = [r for r in VLLM_RANKS if r >= self.rank]
        if not fits:
            raise ValueError(f"adapter rank {self.rank}: vLLM serves ranks up to {VLLM_RANKS[-1]}")
        return fits[0]

    def to_wire(self) -> dict[str, Any]:
        """The JSON object a worker call carries (``AdapterSpec(**wire)`` reads it back)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


@dataclasses.dataclass(frozen=True)
class AdapterPayload:
    """One version of the policy's adapter, as the trainer hands it to ``RolloutEngine.update_weights``.

    Attributes:
        spec: its rank, alpha and targets. buckets: its tensors (PEFT names, ``AdapterSpec.expected_shapes``),
            in buckets as full refreshes carry them; consumed once.
    """

    spec: AdapterSpec
    buckets: Buckets


def split_payload(weights: Any) -> tuple[Any, AdapterSpec | None]:
    """(what a transport moves, the adapter it is or None): a transport moves an adapter's buckets as it moves a full
    refresh's and tells the workers what to build of them."""
    if isinstance(weights, AdapterPayload):
        return weights.buckets, weights.spec
    return weights, None


def spec_of(value: AdapterSpec | dict[str, Any] | None) -> AdapterSpec | None:
    """An ``AdapterSpec`` from itself or its wire form (a worker call's field)."""
    return AdapterSpec(**value) if isinstance(value, dict) else value


def zero_adapter(spec: AdapterSpec, hf_config: dict[str, Any], dtype: torch.dtype = torch.float32) -> Named:
    """The all-zero adapter of ``spec`` on the model of ``hf_config``: the base model's outputs exactly."""
    return [(name, torch.zeros(shape, dtype=dtype)) for name, shape in spec.expected_shapes(hf_config).items()]


def write_adapter_dir(out: Path, spec: AdapterSpec, tensors: Iterable[tuple[str, torch.Tensor]],
                      base_model: str | None = None) -> Path:
    """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``), atomically: what vLLM
    loads an engine's first adapter from and ``peft.PeftModel.from_pretrained`` reads."""
    from safetensors.torch import save_file

    with files.atomic_output_dir(Path(out), overwrite=True) as tmp:
        save_file({n: t.detach().contiguous().cpu() for n, t in tensors}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(spec.peft_config(base_model), indent=1))
    return Path(out)
