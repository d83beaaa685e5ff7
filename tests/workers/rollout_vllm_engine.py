"""The rollout test cases on the in-process ``VLLMEngine`` (run as a subprocess: vLLM's CPU worker patches
process-wide torch settings, which must not leak into the pytest process).

Usage: python rollout_vllm_engine.py MODEL_DIR WORK_DIR     (exit status 0 and a last line "OK ..." on success)
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def check_tied(work: Path) -> None:
    """Tied embeddings: after a refresh the output layer follows the new embedding (vLLM CPU keeps a prepacked
    copy of it that the in-place reload alone leaves stale; the worker extension re-derives it)."""
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from tests.helpers import save_hf_model
    from tests.rollout.tiny import TINY, as_buckets, hf_probe_logprobs, hf_weights, perturbed

    tied_dir = save_hf_model(dict(TINY, tie_word_embeddings=True), work / "tied", seed=5)
    engine = VLLMEngine(tied_dir, dtype="float32", max_model_len=512)
    probe = probes.make_probe_ids(TINY["vocab_size"], 24)
    new = perturbed(hf_weights(tied_dir), 71)
    assert "lm_head.weight" not in new
    engine.update_weights(as_buckets(new), 1)
    probes.verify_refresh(engine, probe, hf_probe_logprobs(tied_dir, new, probe), 1, 1e-3)
    engine.close()


def check_partial_rollouts(model_dir: Path, old: dict, new: dict) -> None:
    """A refresh between two decode steps of the generations in flight (``partial_rollouts``): every token from the
    weights of its own version (``scenarios.check_partial_refresh``), and the refresh verified on the probe."""
    from megatron_offgrpo.rollout import VLLMEngine, probes
    from tests.rollout import scenarios
    from tests.rollout.tiny import TINY, as_buckets, hf_probe_logprobs

    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512, partial_rollouts=True)
    probe = probes.make_probe_ids(TINY["vocab_size"], 24)

    def install(weights: dict, version: int) -> None:
        engine.update_weights(as_buckets(weights), version)
        probes.verify_refresh(engine, probe, hf_probe_logprobs(model_dir, weights, probe), version, 1e-3)

    scenarios.check_partial_refresh(engine, model_dir, old, new, install)
    engine.close()
    gc.collect()


def check_tokenizer_eos(work: Path) -> None:
    """vLLM loads no tokenizer (``skip_tokenizer_init``: requests are token ids in and out), yet every completion
    stops at the tokenizer's end-of-sequence token, read from its files, as vLLM's own eos would stop it, although
    the model's config and generation config name another id. Without the id passed on, the model's frequent
    <|im_end|> (``turn_ending_model``) would not end the completions."""
    import json
    import shutil

    from megatron_offgrpo.data import ASSETS, Prompt, SamplingParams
    from megatron_offgrpo.rollout import VLLMEngine
    from tests.helpers import turn_ending_model

    im_end, endoftext = 151645, 151643
    model = turn_ending_model(work / "eos", eos_id=im_end, seed=4)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"):
        shutil.copy(ASSETS / "qwen2-tokenizer" / name, model / name)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((model / name).read_text())
        (model / name).write_text(json.dumps(dict(config, eos_token_id=endoftext)))
    engine = VLLMEngine(model, dtype="float32", max_model_len=512)
    assert engine.llm.llm_engine.vllm_config.model_config.skip_tokenizer_init
    samples = engine.generate([Prompt("eos/0", tuple(range(100, 110)))], 8,
                              SamplingParams(max_tokens=100, temperature=1.0, seed=5))
    for sample in samples:  # P(no <|im_end|> in 100 tokens) = 0.8^100 per sample
        assert sample.finish_reason == "stop" and sample.response_ids.index(im_end) == len(sample.response_ids) - 1
    engine.close()
    gc.collect()


def check_auto_fallback(model_dir: Path) -> None:
    """engine=auto falls back to the transformers engine, with one warning line naming why, when vLLM cannot start
    (here: a model length past the model's positions, which vLLM refuses)."""
    import warnings

    from megatron_offgrpo.rollout import TransformersEngine, make_engine, specs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = make_engine(specs.VllmSpec(model_dir, "float32", max_model_len=1_000_000, fall_back=True))
    assert isinstance(engine, TransformersEngine), type(engine)
    lines = [str(w.message) for w in caught
             if issubclass(w.category, RuntimeWarning) and "rollout.engine=auto" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0] and "vLLM did not start" in lines[0], lines
    engine.close()


def check_routing_refused_on_dense(model_dir: Path) -> None:
    """record_routing on a dense model: refused at start, in one line (there are no routers to record)."""
    from megatron_offgrpo.rollout import VLLMEngine

    try:
        VLLMEngine(model_dir, dtype="float32", max_model_len=512, record_routing=True)
    except ValueError as exc:
        assert "no `mlp.gate` routers" in str(exc) and "\n" not in str(exc), exc
    else:
        raise AssertionError("record_routing on a dense model was accepted")
    gc.collect()


def main() -> None:
    from megatron_offgrpo.rollout import RolloutEngine, VLLMEngine, make_engine, probes, specs
    from megatron_offgrpo.transports import calls, weights_dir
    from tests.rollout import scenarios
    from tests.rollout.tiny import TINY, as_buckets, hf_weights, perturbed

    model_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    base = hf_weights(model_dir)
    new = {form: perturbed(base, seed) for form, seed in (("memory", 61), ("directory", 62))}
    dirs = {form: weights_dir.write_version_dir(work / form, as_buckets(w), 1, hf_config=dict(TINY))[0]
            for form, w in new.items()}
    fresh = {}
    for form, path in dirs.items():  # fresh engines first: one vLLM engine alive at a time in this process
        engine = VLLMEngine(path, dtype="float32", max_model_len=512)
        fresh[form] = scenarios.greedy(engine)
        engine.close()
        del engine
        gc.collect()
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=512, max_num_seqs=2)
    scenarios.check_priority_admission(engine)
    engine.close()
    del engine
    gc.collect()
    start = time.perf_counter()
    engine = make_engine(specs.VllmSpec(model_dir, "float32", max_model_len=512, fall_back=True))
    assert isinstance(engine, VLLMEngine) and isinstance(engine, RolloutEngine) and engine.version() == 0
    assert engine._rpc(calls.Info()).sampler == "offgrpo-inverse-cdf"  # fleet._cpu_sampler is in place
    scenarios.check_groups(engine)
    scenarios.check_concurrent_generate(engine)
    scenarios.check_prompt_caps(engine)
    scenarios.check_seeded_prompts_over_a_steps_budget(engine)
    scenarios.check_behavior_logprobs(engine, model_dir, None)
    assert scenarios.greedy(engine) != fresh["memory"]
    report = scenarios.check_refresh_matches_fresh(engine, as_buckets(new["memory"]), 1, fresh["memory"])
    assert report.transport == "memory" and set(report.detail) == {"load_s"}, report  # the worker's phases
    refreshed = weights_dir.write_version_dir(work / "v2", as_buckets(new["directory"]), 2)[0]
    report = scenarios.check_refresh_matches_fresh(engine, refreshed, 2, fresh["directory"])
    assert report.transport == "disk" and set(report.detail) == {"read_s", "load_s"}, report
    scenarios.check_rejections(engine, work / "bad", perturbed(base, 63), scenarios.greedy(engine))
    scenarios.check_verification(engine, model_dir, perturbed(base, 64), base,
                                 probes.make_probe_ids(TINY["vocab_size"], 24))
    engine.close()
    del engine
    gc.collect()
    check_tied(work)
    check_tokenizer_eos(work)
    check_partial_rollouts(model_dir, new["directory"], new["memory"])
    check_auto_fallback(model_dir)
    check_routing_refused_on_dense(model_dir)
    print(f"OK in-process vLLM engine: all cases passed ({time.perf_counter() - start:.1f} s after the fresh engines)")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
