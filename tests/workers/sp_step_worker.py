"""torchrun worker: two optimizer steps of the trainer (``TrainerSide.learn``: the layouts, behavior log-probs
recomputed from the snapshot, the KL reference, the fused loss, megatron DDP + optimizer) on fixed samples whose
rows are an odd number of positions, the first step in the padded layout and the second packed. Saves (global rank
0) the two steps' metrics and the updated weights under their HF names, for the test to compare across layouts.

argv: OUT (a .pt file), HF_DIR, then config overrides (parallel.tp=2, parallel.sequence_parallel=..., ...).
With a MoE model every sample carries the experts of each position (router replay), drawn at random.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.data import Sample
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.train._trainer_side import TrainerSide

G = 4
PROMPT_LENGTH, RESPONSE_LENGTHS = 5, (3, 6, 9, 4, 5, 7, 2, 8)  # longest: 5 + 9 - 1 = 13 positions, odd


def fixed_samples(vocab: int, layers: int, experts: int, top_k: int) -> list[Sample]:
    """Two groups of G samples, rewards varying inside each group, behavior log-probs away from the policy's (so
    ratios clip); with ``experts``, random distinct experts per position and layer."""
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i, n in enumerate(RESPONSE_LENGTHS):
        fresh = i % G == 0
        prompt = torch.randint(1, vocab, (PROMPT_LENGTH,), generator=gen).tolist() if fresh else samples[-1].prompt_ids
        response = torch.randint(1, vocab, (n,), generator=gen).tolist()
        behavior = (-2.0 - torch.rand(n, generator=gen)).tolist()
        sample = Sample(f"p{i // G}", i // G, list(prompt), response, behavior, 0, "stop", reward=float(i % 3 == 0))
        if experts:
            scores = torch.rand(len(prompt) + n - 1, layers, experts, generator=gen)
            sample.routed_experts = scores.topk(top_k, dim=-1).indices.to(torch.int16)
        samples.append(sample)
    return samples


def main() -> None:
    out, hf_dir, *overrides = sys.argv[1:]
    arch = load_arch(hf_dir)
    # the load-balancing loss on: rows padded to a multiple of tp add pad positions, which it must leave out
    moe = ["model.router_replay=true", "model.moe_aux_loss_coef=0.01"] if arch.is_moe else []
    config = load_config(None, [f"model.hf_path={hf_dir}", "model.init=hf", "rollout.engine=transformers",
                                f"rollout.group_size={G}", "rollout.prompts_per_step=2", "optim.lr=1e-3",
                                "rollout.behavior_logprobs=recompute", "algo.kl_beta=0.05", "train.deterministic=true",
                                f"train.out_dir={Path(out).parent / 'run'}", *moe, *overrides])
    side = TrainerSide.build(config)
    samples = fixed_samples(arch.vocab_size, arch.num_layers, arch.num_experts if arch.is_moe else 0,
                            arch.moe_top_k if arch.is_moe else 0)
    steps, weights = [], []
    for packing in (False, True):  # the same samples again, packed: rows hold several sequences and a pad tail
        config.optim.packing = packing
        steps.append(side.learn(samples).metrics)
        weights.append({name: t.clone() for bucket in side.weight_buckets() for name, t in bucket})
    if side.ctx.rank == 0:
        torch.save({"steps": steps, "weights": weights}, out)
    print(f"DONE tp={side.ctx.tp_size} sp={side.policy.model.config.sequence_parallel} "
          f"losses={[s['loss'] for s in steps]}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
