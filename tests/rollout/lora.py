"""The rollout tests' LoRA adapters: random adapters of the tiny model, and PEFT's HF forward of base + adapter (the
trainer-side reference an engine's adapter refresh is checked against)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_offgrpo.transports import adapters
from tests.rollout.tiny import TINY, load_hf_model, token_logprobs

SPEC = adapters.AdapterSpec(rank=8, alpha=16.0, target_modules=adapters.TARGETS)
"""Every projection adapted, rank 8 (vLLM's smallest max_lora_rank above 1), scale 2."""


def random_adapter(seed: int, spec: adapters.AdapterSpec = SPEC, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """An adapter of ``spec`` on the tiny model with A and B drawn at random (B nonzero: the outputs move by nats)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: scale * torch.randn(shape, generator=gen)
            for name, shape in spec.expected_shapes(dict(TINY)).items()}


def as_payload(weights: dict[str, torch.Tensor], spec: adapters.AdapterSpec = SPEC) -> adapters.AdapterPayload:
    """The adapter as the trainer hands it over (buckets of 8 tensors)."""
    items = list(weights.items())
    return adapters.AdapterPayload(spec, [items[i:i + 8] for i in range(0, len(items), 8)])


def peft_model(model_dir: Path, weights: dict[str, torch.Tensor], spec: adapters.AdapterSpec = SPEC):
    """The fp32 HF model of ``model_dir`` with the adapter loaded by ``peft.PeftModel.from_pretrained`` from the PEFT
    directory ``adapters.write_adapter_dir`` writes (the directory format is checked on the way)."""
    import tempfile

    from peft import PeftModel

    with tempfile.TemporaryDirectory(prefix="offgrpo-adapter-") as tmp:
        path = adapters.write_adapter_dir(Path(tmp) / "adapter", spec, weights.items(), str(model_dir))
        return PeftModel.from_pretrained(load_hf_model(model_dir, None), str(path)).eval()


def peft_probe_logprobs(model_dir: Path, weights: dict[str, torch.Tensor], probe: list[int],
                        spec: adapters.AdapterSpec = SPEC) -> list[float]:
    """[T-1] log p(probe[t] | probe[:t]) under base + adapter, PEFT's forward in fp32."""
    return token_logprobs(peft_model(model_dir, weights, spec), probe).tolist()
