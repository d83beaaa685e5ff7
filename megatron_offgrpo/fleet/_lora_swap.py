"""The worker's side of an adapter refresh: build vLLM's adapter from the tensors a transport delivered, then swap it
into the engine's one LoRA slot, all or nothing.

vLLM 0.32 keeps an engine's adapters in its worker's LoRA manager (``model_runner.lora_manager``, an LRU worker
manager over a ``LRUCacheLoRAModelManager``): registered ``LoRAModel``s (CPU tensors, B pre-scaled by alpha / rank),
and the active ones copied into each LoRA layer's stacked buffers at a slot index. A request names its adapter by
``lora_int_id``; at every step the runner re-activates the ids of the batch, loading an id from its ``lora_path``
only when it is not registered. The engine serving the policy holds one adapter (``adapters.SLOT_ID``;
``max_loras = max_cpu_loras = 1``), so the id is never evicted, and its path (the version-0 adapter) is read once.

A swap therefore replaces the registered ``LoRAModel`` of that id and copies its weights into the slot, between two
steps (the engine is paused or its loop is ours), so no request computes with half an adapter:
  1. ``build``: every check first (LoRA enabled, rank within ``max_lora_rank``, exactly the adapter's tensor names
     and shapes, all finite), then the ``LoRAModel`` from copies of the tensors (vLLM scales B in place); nothing
     served changes;
  2. ``activate``: unregister the old adapter, register and activate the new one; if that fails, the old one is
     registered and activated again (``RolledBack``: the worker keeps serving the previous version).
vLLM's prefix cache keys blocks by the LoRA id, which does not change: the engine resets it after the swap, as after
a full refresh.
"""

from __future__ import annotations

from typing import Any

import torch

from checkpoint_tools import Named
from megatron_offgrpo.transports import adapters, packing


class RolledBack(RuntimeError):
    """The new adapter could not be activated; the previous one was put back and serves."""


def lora_manager(runner: Any) -> Any | None:
    """The runner's worker LoRA manager, or None when the engine was started without LoRA."""
    if getattr(runner, "lora_config", None) is None:
        return None
    return getattr(runner, "lora_manager", None)


def build(runner: Any, spec: adapters.AdapterSpec, tensors: Named) -> Any:
    """vLLM's ``LoRAModel`` of ``tensors`` (PEFT names) for the engine's slot, after every check.

    Raises:
        ValueError: no LoRA on this engine, a rank above its ``max_lora_rank``, tensors that are not exactly the
            adapter's (names and shapes), non-finite values, or an adapter vLLM refuses.
    """
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = lora_manager(runner)
    if manager is None:
        raise ValueError("this engine was started without LoRA, so it cannot take an adapter: start it with the "
                         "adapter's rank and targets (lora.sync=adapter)")
    config = manager.lora_config
    if spec.rank > config.max_lora_rank:
        raise ValueError(f"adapter rank {spec.rank} exceeds the engine's max_lora_rank {config.max_lora_rank}: start "
                         f"the engine with the adapter's rank")
    others = set(manager.list_adapters()) - {adapters.SLOT_ID}
    if others:
        raise ValueError(f"the engine holds adapters {sorted(others)} besides the policy's slot "
                         f"{adapters.SLOT_ID}: it serves one adapter")
    expected = spec.expected_shapes(runner.model_config.hf_config.to_dict())
    packing.check_complete({n: tuple(t.shape) for n, t in tensors}, expected, what="adapter")
    bad = [n for n, t in tensors if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(f"{len(bad)} adapter tensor(s) hold NaN or infinity (e.g. {bad[:2]})")
    helper = PEFTHelper.from_dict(spec.peft_config())
    helper.validate_legal(config)
    model = runner.get_model()
    mapper = getattr(model, "hf_to_vllm_mapper", None)  # as vLLM's own loader (WorkerLoRAManager._load_adapter)
    return LoRAModel.from_lora_tensors(
        lora_model_id=adapters.SLOT_ID,
        tensors={n: t.detach().to("cpu", copy=True) for n, t in tensors},  # copies: vLLM scales B in place
        peft_helper=helper,
        device="cpu",
        dtype=config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )


def activate(runner: Any, lora: Any) -> None:
    """Make ``lora`` (from ``build``) the adapter of the engine's slot, in place of the one it holds.

    Raises:
        RolledBack: activating it failed and the previous adapter serves again (or, before the first request, none
            was registered: the engine's path still gives the version-0 adapter). Anything else: restoring the
            previous adapter failed too; the slot's weights are undefined.
    """
    manager = lora_manager(runner)._adapter_manager
    previous = manager.get_adapter(adapters.SLOT_ID)
    manager.remove_adapter(adapters.SLOT_ID)
    try:
        manager.add_adapter(lora)
        manager.activate_adapter(adapters.SLOT_ID)
    except Exception as exc:
        manager.remove_adapter(adapters.SLOT_ID)
        if previous is not None:
            manager.add_adapter(previous)
            manager.activate_adapter(adapters.SLOT_ID)
        raise RolledBack(f"{type(exc).__name__}: {exc}") from exc
