"""torchrun worker (1 process) for the router-replay test: a Qwen3-MoE engine (KIND: transformers or vllm) in bf16
and in fp32 samples with its routing recorded; the fp32 megatron trainer scores the sampled tokens with and without
replaying that routing.

Usage: router_replay_worker.py HF_DIR OUT KIND. Writes ``replay.json`` into OUT: per engine dtype, the mean
|trainer - engine| log-prob of the sampled tokens both ways, the largest change replay makes, and both mismatches over
the tokens replay moves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_offgrpo.runtime import init_parallel


def main(hf_dir: Path, out: Path, kind: str) -> None:
    from checkpoint_tools import load_hf_into_stage, open_safetensors_dir
    from megatron_offgrpo.data import Prompt, SamplingParams
    from megatron_offgrpo.model import build_gpt_stage, expose_hidden_states, load_arch, transformer_config
    from megatron_offgrpo.rollout import make_engine, specs
    from megatron_offgrpo.train._batch import build_microbatches
    from megatron_offgrpo.train._step import token_logprobs

    arch = load_arch(hf_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [Prompt(f"p{i}", tuple(torch.randint(1, arch.vocab_size, (12,), generator=gen).tolist()))
               for i in range(4)]
    sampled = {}
    for dtype in ("bfloat16", "float32"):  # every engine closed before megatron starts: vLLM's shutdown tears down
        if kind == "vllm":                 # torch.distributed's default group
            engine = make_engine(specs.VllmSpec(hf_dir, dtype, max_model_len=64, max_num_seqs=16, record_routing=True))
        else:
            engine = make_engine(specs.TransformersSpec(hf_dir, dtype, record_routing=True))
        sampled[dtype] = engine.generate(prompts, 4, SamplingParams(max_tokens=16, temperature=1.0, seed=1))
        engine.close()
    ctx = init_parallel(1, 1)
    model = build_gpt_stage(arch, transformer_config(arch, routing_replay=True), True, True)
    load_hf_into_stage(model, arch, open_safetensors_dir(hf_dir), 1, 0, 1, 0)
    model = expose_hidden_states(model).eval()
    result = {}
    for dtype, samples in sampled.items():
        assert all(s.routed_experts.shape[1:] == (arch.num_layers, arch.moe_top_k) for s in samples)
        n = len(samples)
        mbs = build_microbatches(samples, torch.zeros(n), torch.ones(n, dtype=torch.bool), 4)
        replayed = token_logprobs(model, ctx, mbs)
        for mb in mbs:
            mb.routed_experts = None
        own = token_logprobs(model, ctx, mbs)
        mask = torch.cat([mb.loss_mask.reshape(-1) for mb in mbs])
        engine_logp = torch.cat([mb.behavior_logp.reshape(-1) for mb in mbs])[mask]
        with_replay = torch.cat([lp.reshape(-1) for lp in replayed])[mask]
        without = torch.cat([lp.reshape(-1) for lp in own])[mask]
        moved = (with_replay - without).abs() > 1e-4  # tokens a routing flip reaches (attention spreads it on)
        result[dtype] = {"with_replay": float((with_replay - engine_logp).abs().mean()),
                         "without_replay": float((without - engine_logp).abs().mean()), "tokens": int(mask.sum()),
                         "replay_changes_logp": float((with_replay - without).abs().max()),
                         "moved_tokens": int(moved.sum()),
                         "moved_with_replay": float((with_replay - engine_logp)[moved].abs().mean()),
                         "moved_without_replay": float((without - engine_logp)[moved].abs().mean())}
    (out / "replay.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
