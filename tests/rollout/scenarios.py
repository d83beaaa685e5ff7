"""The rollout test cases, written once against the ``RolloutEngine`` interface and run on every engine
(the vLLM fleet, the in-process vLLM engine, the transformers engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from megatron_offgrpo.data import Prompt, SamplingParams
from megatron_offgrpo.rollout import RefreshReport
from megatron_offgrpo.rollout._errors import RefreshError, RefreshVerificationError
from megatron_offgrpo.rollout._verify import verify_refresh
from megatron_offgrpo.transports import weights_dir
from tests.rollout.tiny import as_buckets, hf_probe_logprobs, load_hf_model, token_logprobs

PROMPTS = [Prompt(f"test/{i}", tuple(range(10 + 7 * i, 22 + 7 * i))) for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=10, temperature=1.0, seed=3)


def greedy(engine, prompts=PROMPTS) -> list[list[int]]:
    """One greedy continuation per prompt."""
    return [s.response_ids for s in engine.generate(prompts, 1, GREEDY)]


def check_groups(engine, n: int = 4) -> None:
    """Groups come back complete, in order, each from one server and tagged with the served version."""
    samples = engine.generate(PROMPTS, n, SAMPLED)
    assert len(samples) == len(PROMPTS) * n
    for index, prompt in enumerate(PROMPTS):
        group = samples[index * n : (index + 1) * n]
        assert {s.group_id for s in group} == {index} and {s.prompt_id for s in group} == {prompt.prompt_id}
        assert len({s.server for s in group}) == 1 and {s.policy_version for s in group} == {engine.version()}
        for s in group:
            assert s.prompt_ids == list(prompt.prompt_ids) and 1 <= len(s.response_ids) <= SAMPLED.max_tokens
            assert len(s.behavior_logprobs) == len(s.response_ids) and all(lp <= 0 for lp in s.behavior_logprobs)
            assert s.finish_reason in ("stop", "length")
    assert len({tuple(s.response_ids) for s in samples[:n]}) > 1  # sampled, not copies


def check_behavior_logprobs(
    engine, model_dir: Path, weights: dict | None, temperature: float = 0.7, atol: float = 1e-3
) -> None:
    """Each sampled token's log-prob is log-softmax(logits / temperature) of the served weights at that position
    (what the trainer recomputes for the importance ratio), checked against a fp32 HF forward."""
    model = load_hf_model(model_dir, weights)
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=9)
    for sample in engine.generate(PROMPTS[:3], 2, params):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1].float() / temperature
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(sample.behavior_logprobs), expected, atol=atol), (
            sample.behavior_logprobs,
            expected.tolist(),
        )


def check_refresh_matches_fresh(engine, weights, version: int, fresh_greedy: list[list[int]]) -> RefreshReport:
    """After a refresh, greedy outputs equal a freshly loaded engine's, and samples carry the new version; returns
    the refresh's report."""
    report = engine.update_weights(weights, version)
    assert report.version == version == engine.version() and all(v == version for v in report.servers.values())
    samples = engine.generate(PROMPTS, 1, GREEDY)
    assert [s.response_ids for s in samples] == fresh_greedy
    assert {s.policy_version for s in samples} == {version}
    return report


def check_rejections(engine, tmp: Path, weights: dict[str, torch.Tensor], before: list[list[int]]) -> None:
    """A corrupt file, a stale or mismatched version are rejected; the old weights keep serving."""
    served = engine.version()
    nxt = served + 1
    path, _ = weights_dir.write_version_dir(weights_dir.version_dir(tmp, nxt), as_buckets(weights), nxt)
    shard = path / "model-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) - 100] ^= 0xFF  # one flipped byte in a tensor's data
    shard.write_bytes(bytes(raw))
    with pytest.raises(RefreshError, match=f"(?s)version {nxt}.*does not match the manifest"):
        engine.update_weights(path, nxt)
    with pytest.raises(ValueError, match=f"already serves version {served}"):
        engine.update_weights(as_buckets(weights), served)
    other, _ = weights_dir.write_version_dir(
        weights_dir.version_dir(tmp / "other", nxt + 5), as_buckets(weights), nxt + 5
    )
    with pytest.raises((ValueError, RefreshError), match=f"(?s)version {nxt + 5}"):
        engine.update_weights(other, nxt)
    assert engine.version() == served and greedy(engine) == before


def check_verification(
    engine, model_dir: Path, good: dict, stale_from: dict, probe: list[int], atol: float = 1e-3
) -> None:
    """The probe verification passes on the right weights and names the version when a tensor is wrong."""
    version = engine.version() + 1
    engine.update_weights(as_buckets(good), version)
    expected = hf_probe_logprobs(model_dir, good, probe)
    errors = verify_refresh(engine, probe, expected, version, atol)
    assert all(err < atol for err in errors.values())
    transposed = dict(good)
    name = "model.layers.1.self_attn.o_proj.weight"  # [128, 128]: a transposed copy passes every shape check
    transposed[name] = good[name].t().contiguous()
    engine.update_weights(as_buckets(transposed), version + 1)
    with pytest.raises(RefreshVerificationError, match=f"version {version + 1}") as caught:
        verify_refresh(engine, probe, hf_probe_logprobs(model_dir, good, probe), version + 1, atol)
    assert set(caught.value.servers) == set(engine.probe_logprobs(probe))  # every server is named
    stale = dict(good)
    stale["model.layers.0.mlp.gate_proj.weight"] = stale_from[
        "model.layers.0.mlp.gate_proj.weight"
    ]  # one tensor of an old version
    engine.update_weights(as_buckets(stale), version + 2)
    with pytest.raises(RefreshVerificationError, match=f"version {version + 2}"):
        verify_refresh(engine, probe, hf_probe_logprobs(model_dir, good, probe), version + 2, atol)
    with pytest.raises(RefreshVerificationError, match="serves version"):  # a refresh that did not happen
        verify_refresh(engine, probe, expected, version + 3, atol)


def check_concurrent_generate(engine) -> None:
    """Generations asked for from two threads at once: each gets exactly its own samples, as when asked alone; and
    where the engine shares one batch between callers (``concurrent_generate``), a short generation asked for while
    a long one runs finishes first instead of waiting for the long one's end (what ``rollout.mode=async`` relies on
    to generate several steps' groups at once)."""
    import threading
    import time

    # 400 tokens and a 0.2 s head start: on a quiet machine 200 tokens of the tiny model were done before a short
    # request asked 0.5 s in could finish (the check then failed though the batch was shared)
    long_params = SamplingParams(max_tokens=400, temperature=1.0, seed=11)
    short_params = SamplingParams(max_tokens=4, temperature=0.0)
    alone = engine.generate(PROMPTS[5:6], 1, short_params)
    finished: dict[str, float] = {}
    results: dict[str, list] = {}

    def ask(name: str, prompts, n: int, params) -> None:
        results[name] = engine.generate(prompts, n, params)
        finished[name] = time.perf_counter()

    long_run = threading.Thread(target=ask, args=("long", PROMPTS[:4], 2, long_params))
    long_run.start()
    time.sleep(0.2)  # the long generation is decoding
    ask("short", PROMPTS[5:6], 1, short_params)
    long_run.join()
    assert [s.response_ids for s in results["short"]] == [s.response_ids for s in alone]
    assert len(results["long"]) == 8 and [s.group_id for s in results["long"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    longest = max(len(s.response_ids) for s in results["long"])
    if getattr(engine, "concurrent_generate", False):
        assert longest > 50, f"the long generation ended after {longest} tokens: too short to tell"
        assert finished["short"] < finished["long"], "the short generation waited for the long one"


def check_priority_admission(engine) -> None:
    """With the batch full (an engine decoding 2 sequences at once), a request of lower ``priority`` asked for while
    a higher one's requests wait is admitted before them: it ends first, where first come, first served would run
    it after all of them (``rollout.mode=async`` gives the oldest step the lowest number)."""
    import dataclasses
    import threading
    import time

    # long enough that the later request's 4 rounds outlast the 0.5 s head start on any machine: at 40 tokens a
    # quick CPU decoded all 8 sequences before the oldest arrived (a loaded one admitted them first: flaky)
    later = SamplingParams(max_tokens=160, temperature=1.0, seed=13, priority=5)
    finished: dict[str, float] = {}
    results: dict[str, list] = {}

    def ask(name: str, prompts, params) -> None:
        results[name] = engine.generate(prompts, 2, params)
        finished[name] = time.perf_counter()

    queued = threading.Thread(target=ask, args=("later", PROMPTS[:4], later))  # 8 sequences: 4 rounds of 2
    queued.start()
    time.sleep(0.5)  # its first 2 sequences decode, 6 wait
    ask("oldest", PROMPTS[5:6], dataclasses.replace(later, priority=1))
    queued.join()
    assert len(results["later"]) == 8 and len(results["oldest"]) == 2
    assert max(len(s.response_ids) for s in results["later"]) > 80, "too short to tell"
    assert finished["oldest"] < finished["later"], "the lower priority waited for the higher one's requests"


def check_prompt_caps(engine) -> None:
    """A prompt's own ``max_new_tokens`` caps its completions under the call's ``max_tokens`` (a data row's cap)."""
    import dataclasses

    params = SamplingParams(max_tokens=40, temperature=1.0, seed=5)
    prompts = [dataclasses.replace(PROMPTS[0], max_new_tokens=3), PROMPTS[1]]
    samples = engine.generate(prompts, 2, params)
    assert all(len(s.response_ids) <= 3 for s in samples[:2])
    assert max(len(s.response_ids) for s in samples[2:]) > 3


def check_partial_refresh(engine, model_dir: Path, old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                          install: Callable[[dict[str, torch.Tensor], int], object],
                          model_of: Callable[[dict[str, torch.Tensor]], object] | None = None) -> None:
    """A refresh while generations are in flight (``partial_rollouts``): they go on under the new weights; each token
    carries the version that sampled it (the old one first, then the new one), the sample the oldest; and each
    token's behavior log-prob is the one its own version's weights give it on the whole sequence before it (the
    refresh recomputed the in-flight requests' KV: a token sampled on the old weights' cache would be off by nats on
    this model). ``install(weights, version)`` refreshes the engine; ``model_of(weights)`` is the fp32 HF model that
    serves them (default: the model directory holding ``weights``; an adapter refresh gives PEFT's base + adapter)."""
    import threading
    import time

    first = engine.version() + 1
    install(old, first)  # known weights: the engine may hold anything a previous case installed
    # the refresh must land while the generations decode, on a quick machine or a loaded one: time 50 tokens of the
    # same batch first (a fresh engine's first-request costs out of the way too), then refresh ~100 tokens into 400
    start = time.perf_counter()
    engine.generate(PROMPTS[:2], 2, SamplingParams(max_tokens=50, temperature=1.0, seed=4))
    per_50 = time.perf_counter() - start
    results = []
    long_run = threading.Thread(target=lambda: results.extend(
        engine.generate(PROMPTS[:2], 2, SamplingParams(max_tokens=400, temperature=1.0, seed=4))))
    long_run.start()
    time.sleep(2 * per_50)
    install(new, first + 1)
    long_run.join()
    mixed = [s for s in results if s.token_versions is not None]
    assert mixed, [len(s.response_ids) for s in results]
    model_of = model_of or (lambda weights: load_hf_model(model_dir, weights))
    models = {first: model_of(old), first + 1: model_of(new)}
    for sample in mixed:
        switch = sample.token_versions.index(first + 1)
        assert 0 < switch and set(sample.token_versions[:switch]) == {first}
        assert set(sample.token_versions[switch:]) == {first + 1} and sample.policy_version == first
        ids, start = list(sample.prompt_ids) + list(sample.response_ids), len(sample.prompt_ids)
        logp = {v: token_logprobs(m, ids)[start - 1:] for v, m in models.items()}
        expected = torch.where(torch.tensor(sample.token_versions) == first, logp[first], logp[first + 1])
        torch.testing.assert_close(torch.tensor(sample.behavior_logprobs), expected, atol=2e-3, rtol=0)
    assert all(s.policy_version == first + 1 and s.token_versions is None
               for s in engine.generate(PROMPTS[:1], 2, SAMPLED))


def check_seeded_prompts_over_a_steps_budget(engine) -> None:
    """Seeded requests whose prompts together pass one step's token budget (vLLM's default 2048): on CPU a prompt
    split over two steps crashed vLLM's engine (it rewinds the seeded generator of the token it drops, and a CPU
    generator has no offset), so the engines schedule every prompt whole (``fleet.serving.cpu_prefill_limits``)."""
    prompts = [Prompt(f"budget/{i}", tuple((7 * i + t) % 4000 + 10 for t in range(200))) for i in range(16)]
    samples = engine.generate(prompts, 2, SamplingParams(max_tokens=4, temperature=1.0, seed=9))
    assert len(samples) == 32 and all(1 <= len(s.response_ids) <= 4 for s in samples)
