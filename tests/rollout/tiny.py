"""The rollout tests' model: a tiny Qwen2 that vLLM's CPU attention accepts, and weight variants of it.

The model: hidden 128, 2 heads of 64 (vLLM CPU head sizes are 32, 64, 80, ...; it uses hidden / heads), 2 KV
heads, 2 layers, SwiGLU 256, a 4096-token vocabulary (token ids in and out, so no tokenizer is needed), and a
large init (std 0.2) so that its next-token distributions are peaked: a wrong tensor moves the probe's
log-probs by whole nats, and greedy continuations are stable under float reordering.
"""

from __future__ import annotations

from pathlib import Path

import torch


TINY = dict(
    model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=4096, hidden_size=128, intermediate_size=256,
    num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, hidden_act="silu", rms_norm_eps=1e-6,
    rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2,
)


def hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF directory (name -> tensor)."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """A new version of ``weights``: each tensor plus ``scale`` x its std x noise (greedy outputs change)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (t + scale * t.float().std().clamp_min(1e-3) * torch.randn(t.shape, generator=gen)).to(t.dtype)
            for n, t in weights.items()}


def as_buckets(weights: dict[str, torch.Tensor], per_bucket: int = 8) -> list[list[tuple[str, torch.Tensor]]]:
    """The tensors in buckets of ``per_bucket`` (as ``stream_hf_buckets`` would yield them)."""
    items = list(weights.items())
    return [items[i:i + per_bucket] for i in range(0, len(items), per_bucket)]


def hf_probe_logprobs(model_dir: Path, weights: dict[str, torch.Tensor] | None, probe: list[int]) -> list[float]:
    """The trainer-side reference: a fp32 HF forward of ``weights`` (None: the directory's) on ``probe``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # tied: lm_head is the embedding
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        ids = torch.tensor([probe])
        return model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()
