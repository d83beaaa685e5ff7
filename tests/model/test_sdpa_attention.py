"""The local spec's SdpaAttention computes what megatron's DotProductAttention computes (causal, grouped-query
heads, fp32 and bf16, forward and backward), and hands the cases SDPA does not cover back to it."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.model import QwenArch, transformer_config

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 24, 3, 4, 2, 16


@pytest.fixture(scope="module")
def parallel():
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    ctx = init_parallel(1, 1, seed=7)
    yield ctx
    destroy_parallel()


def _attention(cls, dtype: torch.dtype):
    from megatron.core.transformer.enums import AttnMaskType

    arch = QwenArch(model_type="qwen2", vocab_size=64, hidden_size=HEADS * HEAD_DIM, intermediate_size=32,
                    num_layers=1, num_heads=HEADS, num_kv_heads=GROUPS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
                    rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True,
                    qk_norm=False)
    config = transformer_config(arch, 1, 1, params_dtype=dtype)
    return cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _qkv(dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(SEQ, BATCH, HEADS, HEAD_DIM), (SEQ, BATCH, GROUPS, HEAD_DIM), (SEQ, BATCH, GROUPS, HEAD_DIM)]
    return [torch.randn(s, generator=gen).to(dtype).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_matches_dot_product_attention(parallel, dtype, tol):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_offgrpo.model._sdpa import SdpaAttention

    for seed in range(3):
        outputs = []
        for cls in (DotProductAttention, SdpaAttention):
            q, k, v = _qkv(dtype, seed)
            out = _attention(cls, dtype)(q, k, v, attention_mask=None)
            (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outputs.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
        assert outputs[1][0].shape == (SEQ, BATCH, HEADS * HEAD_DIM)
        for name, ours, theirs in zip(("out", "dq", "dk", "dv"), outputs[1], outputs[0]):
            rel = ((ours - theirs).norm() / theirs.norm()).item()
            assert rel <= tol, f"{name} ({dtype}, seed {seed}): relative difference {rel:.2e} > {tol:g}"


def test_an_explicit_boolean_mask_is_the_whole_mask(parallel):
    from megatron_offgrpo.model._sdpa import SdpaAttention

    attention = _attention(SdpaAttention, torch.float32)
    q, k, v = _qkv(torch.float32, 0)
    full = attention(q, k, v, attention_mask=None)
    # megatron's mask marks the blocked positions True: block every key but the first for every query
    mask = torch.ones(BATCH, 1, SEQ, SEQ, dtype=torch.bool)
    mask[..., 0] = False
    masked = attention(q, k, v, attention_mask=mask)
    first_key_only = v[:1].repeat_interleave(HEADS // GROUPS, dim=2).expand(SEQ, -1, -1, -1).reshape(SEQ, BATCH, -1)
    torch.testing.assert_close(masked, first_key_only)
    assert not torch.allclose(masked, full)


def test_a_block_causal_mask_matches_megatron_and_separate_sequences(parallel):
    """Packed rows (train._packing): SDPA under the block-diagonal causal mask equals megatron's unfused attention
    under it, and each sequence's outputs equal those of the sequence alone."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_offgrpo.model._sdpa import SdpaAttention
    from megatron_offgrpo.train._packing import block_causal_mask

    lengths = [10, 9]  # + 5 pad positions
    mask = block_causal_mask(lengths, SEQ).expand(BATCH, 1, SEQ, SEQ)
    q, k, v = _qkv(torch.float32, 1)
    ours = _attention(SdpaAttention, torch.float32)(q, k, v, attention_mask=mask)
    theirs = _attention(DotProductAttention, torch.float32)(q, k, v, attention_mask=mask)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    start = 0
    for n in lengths:
        span = slice(start, start + n)
        alone = _attention(SdpaAttention, torch.float32)(q[span], k[span], v[span], attention_mask=None)
        torch.testing.assert_close(ours[span], alone, rtol=1e-5, atol=1e-6)
        start += n
