"""The rollout tests' model: a tiny Qwen2 that vLLM's CPU attention accepts, and weight variants of it.

The model: hidden 128, 2 heads of 64 (vLLM CPU head sizes are 32, 64, 80, ...; it uses hidden / heads), 2 KV
heads, 2 layers, SwiGLU 256, a 4096-token vocabulary (token ids in and out, so no tokenizer is needed), and a
large init (std 0.2) so that its next-token distributions are peaked: a wrong tensor moves the probe's
log-probs by whole nats, and greedy continuations are stable under float reordering.

The MoE twin (``TINY_MOE``): a Qwen3-MoE of the same size whose MLPs are 8 experts (top-2, renormalised) of
intermediate size 64 (a multiple of 32: vLLM CPU pads other sizes), 4 heads of 32 (Qwen3 takes ``head_dim`` from
the config), with the same large init so that a wrong or mis-laid-out expert moves the probe by nats.
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

TINY_MOE = dict(
    TINY, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_attention_heads=4, head_dim=32,
    attention_bias=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
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
    return token_logprobs(load_hf_model(model_dir, weights), probe).tolist()


def token_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[T-1] log p(ids[t] | ids[:t]) under a HF ``model``, fp32."""
    with torch.no_grad():
        seq = torch.tensor([ids])
        return model(seq).logits[0, :-1].log_softmax(-1).gather(-1, seq[0, 1:, None])[:, 0]


def load_hf_model(model_dir: Path, weights: dict[str, torch.Tensor] | None):
    """The fp32 HF model of ``model_dir`` holding ``weights`` (checkpoint names; None: the directory's).

    transformers >= 5 holds a MoE layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H]: each expert's
    gate rows then its up rows; ``down_proj`` [E, H, I]) where checkpoints name them one expert at a time."""
    import re

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is None:
        return model
    params = dict(model.named_parameters())
    plain = {}
    with torch.no_grad():
        for name, tensor in weights.items():
            match = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
            if match is None or name in params:
                plain[name] = tensor
                continue
            prefix, expert, kind = match.group(1), int(match.group(2)), match.group(3)
            if kind == "down":
                params[f"{prefix}.down_proj"][expert].copy_(tensor)
            else:
                rows = params[f"{prefix}.gate_up_proj"][expert]
                half = rows.shape[0] // 2
                (rows[:half] if kind == "gate" else rows[half:]).copy_(tensor)
    missing, unexpected = model.load_state_dict(plain, strict=False)
    fused = {n for n in missing if re.search(r"\.mlp\.experts\.(gate_up|down)_proj$", n)}
    # tied: lm_head is the embedding; fused experts were copied above
    assert not unexpected and set(missing) - fused <= {"lm_head.weight"}, (missing, unexpected)
    return model


def routing_mismatches(model_dir: Path, weights: dict[str, torch.Tensor] | None, samples: list) -> tuple[int, int]:
    """(positions x layers whose expert set differs, all of them) between each sample's recorded routing and a fp32
    HF forward of its input positions (prompt and response less its last token)."""
    from megatron_offgrpo.rollout._routing import RoutingRecorder

    model = load_hf_model(model_dir, weights)
    recorder = RoutingRecorder(model)
    differ = total = 0
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids[:-1]])
        with recorder.recording(), torch.no_grad():
            model(ids)
        hf = recorder.per_row(1, ids.shape[1])[0].long().sort(-1).values
        got = sample.routed_experts.long().sort(-1).values
        differ += int((hf != got).any(-1).sum())
        total += hf.shape[0] * hf.shape[1]
    return differ, total


CLASSIFIER = dict(TINY, architectures=["Qwen2ForSequenceClassification"], num_labels=1, pad_token_id=0)
"""The tiny Qwen2 as a scalar reward model (one label); token 0 pads (HF pools the last token that is not 0)."""


def save_classifier(directory: Path, seed: int = 0) -> Path:
    """Save a random ``CLASSIFIER`` (fp32 safetensors, its score head included) into ``directory``; returns it."""
    import transformers

    config = transformers.AutoConfig.for_model(**CLASSIFIER)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def classifier_logits(model_dir: Path, sequences: list[list[int]]) -> list[float]:
    """The fp32 HF reference: each sequence's ``[1]`` logit, one forward per sequence (no padding)."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in sequences]
