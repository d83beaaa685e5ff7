"""Benchmark: trainer throughput of padded, packed and shared-prompt micro-batches on long-tailed lengths.

One process, the trainer's own step (``train._policy.build_policy``, ``train._step.policy_step``: megatron's schedule,
the fused loss, the optimizer) on a random-init Qwen2 with the real 151,936-token vocabulary, fed the same samples
three times: padded (``train._batch.build_microbatches``: every row as long as the step's longest sequence), packed
(``train._packing.build_packed_microbatches``, ``optim.packing=true``: whole sequences back to back in rows of that
length) and shared (``train._shared_prompt.build_shared_prompt_microbatches``, ``optim.shared_prompt=true``: each
group's prompt once, its samples' responses as branches under a tree mask). Lengths are GSM8K-like with a long tail:
one prompt per group ~ N(100, 25) tokens in [40, 200] (a group's G samples share it, as a rollout's do), responses
log-normal with median ``--median`` tokens in [8, ``--max-response``]. Packing saves the layers' work on padding and
sharing the work on G - 1 copies of each prompt, not the output layer's (the loss only computes response tokens in
every layout), so the gain depends on the layers' share of a step: the defaults keep Qwen2.5-0.5B's ratio of layer
FLOPs to output-layer FLOPs per token (about 3) at a width a CPU trains in seconds. Reports positions per step,
median step seconds and real tokens (prompt + response, as the padded layout counts them) per second of each, and
their ratios, measured in one run (alternating rounds).

Usage: python benchmarks/packing.py [--hidden 256] [--layers 8] [--vocab 8192] [--samples 64] [--median 150]
[--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def lengths(args) -> list[tuple[int, int]]:
    """(prompt, response) token counts of ``args.samples`` samples, seeded; one prompt length per group."""
    import random

    rng = random.Random(args.seed)
    out = []
    for i in range(args.samples):
        if i % args.group_size == 0:
            prompt = min(200, max(40, round(rng.gauss(100, 25))))
        response = min(args.max_response, max(8, round(math.exp(rng.gauss(math.log(args.median), args.sigma)))))
        out.append((prompt, response))
    return out


def samples_of(shape: list[tuple[int, int]], vocab: int, group_size: int, seed: int) -> list:
    """Samples of those lengths with random tokens; the G samples of a group share their prompt's tokens."""
    import torch

    from megatron_offgrpo.data import Sample

    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, response) in enumerate(shape):
        if i % group_size == 0:
            prompt_ids = torch.randint(1, vocab, (prompt,), generator=gen).tolist()
        ids = torch.randint(1, vocab, (response,), generator=gen).tolist()
        out.append(Sample(prompt_id=f"p{i // group_size}", group_id=i // group_size, prompt_ids=prompt_ids,
                          response_ids=ids, behavior_logprobs=[-math.log(vocab)] * response,
                          policy_version=0, finish_reason="stop", reward=float(i % 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks._tables import markdown

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random Qwen2")
    parser.add_argument("--layers", type=int, default=8, help="transformer layers")
    parser.add_argument("--vocab", type=int, default=8192,
                        help="vocabulary (the default keeps Qwen2.5-0.5B's body-to-output-layer FLOP ratio per token "
                             "at CPU-sized widths: 12 L h / V = 3.0; 151936 is the real one)")
    parser.add_argument("--samples", type=int, default=64, help="samples per step (8 prompts x 8)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=int, default=150, help="median response tokens")
    parser.add_argument("--sigma", type=float, default=0.7, help="log-normal sigma of the response length")
    parser.add_argument("--max-response", type=int, default=1024, help="longest response")
    parser.add_argument("--budget", type=int, default=8192, help="optim.micro_batch_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each layout (alternating)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "packing", help="where the JSON result goes")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU benchmark: gloo and CPU tensors
    import torch

    from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
    from megatron_offgrpo.config import ModelConfig, OptimConfig
    from megatron_offgrpo.model import load_arch
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel, tune_cpu_memory
    from megatron_offgrpo.train import (build_microbatches, build_packed_microbatches, build_policy,
                                        build_shared_prompt_microbatches, global_seq_count, global_token_count,
                                        policy_step)

    tune_cpu_memory()  # as `offgrpo train` does: a step's large buffers reuse their pages

    config = json.loads((REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2" / "config.json").read_text())
    config.update(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=3 * args.hidden,
                  vocab_size=args.vocab,
                  num_attention_heads=max(2, args.hidden // 64), num_key_value_heads=2,
                  max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(config))
        ctx = init_parallel(1, 1, args.seed)
        try:
            arch = load_arch(model_dir)
            policy = build_policy(arch, ctx, ModelConfig(hf_path=model_dir, init="random"), OptimConfig(lr=1e-6),
                                  2 * (args.repeats + 1))
            shape = lengths(args)
            samples = samples_of(shape, arch.vocab_size, args.group_size, args.seed)
            rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
            adv = compute_group_advantages(rewards, args.group_size, AdvantageParams())
            tokens, seqs = global_token_count(samples, adv.sample_valid), global_seq_count(adv.sample_valid)
            layouts = {name: build(samples, adv.advantages, adv.sample_valid, args.group_size, 0, 1, args.budget)
                       for name, build in (("padded", build_microbatches), ("packed", build_packed_microbatches),
                                           ("shared", build_shared_prompt_microbatches))}
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for round_ in range(args.repeats + 1):  # round 0 warms up; then the layouts alternate
                for name, mbs in layouts.items():
                    start = time.perf_counter()
                    result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, ObjectiveParams(), tokens, seqs)
                    if round_:
                        times[name].append(time.perf_counter() - start)
                    if not math.isfinite(result.loss):
                        raise SystemExit(f"packing: non-finite loss with {name} micro-batches")
        finally:
            destroy_parallel()
    real = sum(p + r for p, r in shape)
    responses = sorted(r for _, r in shape)
    rows = []
    for name, mbs in layouts.items():
        seconds = statistics.median(times[name])
        rows.append({"layout": name, "micro-batches": len(mbs), "rows x positions": f"{mbs[0].tokens.shape[0]} x "
                     f"{mbs[0].tokens.shape[1]}", "positions": sum(mb.tokens.numel() for mb in mbs),
                     "step s (median)": round(seconds, 3), "real tokens/s": round(real / seconds, 1)})
    seconds = {row["layout"]: row["step s (median)"] for row in rows}
    positions = {row["layout"]: row["positions"] for row in rows}
    pairs = (("packed", "padded"), ("shared", "padded"), ("shared", "packed"))
    ratios = {f"{a} vs {b}": {"tokens/s": round(seconds[b] / seconds[a], 3),
                              "positions": round(positions[a] / positions[b], 3)} for a, b in pairs}
    print(f"model: Qwen2 random, hidden {args.hidden}, {args.layers} layers, vocab {config['vocab_size']}; "
          f"{args.samples} samples ({len(samples) // args.group_size} prompts x {args.group_size}), {real} real "
          f"tokens; response tokens median {responses[len(responses) // 2]}, max {responses[-1]}; "
          f"{args.repeats} timed steps of each")
    print(markdown(list(rows[0]), rows))
    for pair, ratio in ratios.items():
        print(f"{pair}: {ratio['tokens/s']:.2f}x the tokens/s, {ratio['positions']:.2f}x the positions")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packing.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "rows": rows, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
