"""Rotary angles from position ids (model._rope): in a shared-prompt row (train._shared_prompt) every branch token's
logits equal those of its plain unpacked sequence (fp32, 1e-5), which megatron's row-length RoPE alone gets wrong."""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import Sample
from megatron_offgrpo.model import QwenArch, build_gpt_stage, transformer_config


@pytest.fixture(scope="module")
def stage():
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel

    init_parallel(1, 1, seed=11)
    arch = QwenArch(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                    max_position_embeddings=64, tie_word_embeddings=True, qkv_bias=True, qk_norm=False)
    model = build_gpt_stage(arch, transformer_config(arch, 1, 1), pre_process=True, post_process=True).eval()
    yield model
    destroy_parallel()


def _group() -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 96, (6,), generator=gen).tolist()
    return [Sample(prompt_id="p", group_id=0, prompt_ids=prompt, response_ids=torch.randint(1, 96, (n,),
                   generator=gen).tolist(), behavior_logprobs=[-1.0] * n, policy_version=0, finish_reason="stop",
                   reward=float(i)) for i, n in enumerate((5, 9, 3))]


@torch.no_grad()
def _shared_vs_plain(stage) -> float:
    from megatron_offgrpo.train._shared_prompt import build_shared_prompt_microbatches

    samples = _group()
    (mb,) = build_shared_prompt_microbatches(samples, torch.zeros(3), torch.ones(3, dtype=torch.bool), 3,
                                             token_budget=10**6)
    shared = stage(mb.tokens, mb.positions, mb.attention_mask)[0]  # [L, V]
    worst = 0.0
    for branch, sample in enumerate(samples):
        full = torch.tensor(sample.prompt_ids + sample.response_ids[:-1]).unsqueeze(0)
        plain = stage(full, torch.arange(full.shape[1]).unsqueeze(0), None)[0]  # megatron's own causal path
        spots = (mb.seq_ids[0] == branch + 1).nonzero().squeeze(1)  # seq id 0 is the prefix
        if branch == 0:
            spots = torch.cat([(mb.seq_ids[0] == 0).nonzero().squeeze(1), spots])
        ours, theirs = shared[spots], plain[mb.positions[0, spots]]
        worst = max(worst, ((ours - theirs).abs().max() / theirs.abs().max()).item())
    return worst


def test_a_branch_has_the_logits_of_its_unpacked_sequence(stage):
    assert _shared_vs_plain(stage) <= 1e-5


def test_without_position_ids_later_branches_are_wrong(stage, monkeypatch):
    # megatron alone: angles of the place in the row, shifted by the earlier branches' lengths
    monkeypatch.setattr(stage, "_forward_pre_hooks", type(stage._forward_pre_hooks)())
    stage.rotary_pos_emb.__dict__.pop("position_ids", None)
    assert _shared_vs_plain(stage) > 1e-3
