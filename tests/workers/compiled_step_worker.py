"""Worker: a step variant trains what the eager step trains. Two policies from the same seed (eager without
gradient-accumulation fusion, then the variant given as ``model.`` keys: ``compile=true compile_mode=reduce-overhead``,
``grad_accum_fusion=true``, ...) take the same optimizer step on the same micro-batches; prints the relative
differences of the loss and the main gradients and how many weights the variant's fused weight-gradient GEMMs
accumulated into, ``COMPILED loss=<d> grads=<d> fused=<n>``. (Not the updated weights: Adam's first step moves
every weight by about lr whatever its gradient's size, so a gradient near 0 flips its update on rounding noise.)
"""

from __future__ import annotations

import math
import sys

import torch

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
from megatron_offgrpo.config import ModelConfig, OptimConfig
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import destroy_parallel, init_parallel
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._checkpoint import _rng_state, _set_rng_state
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._step import policy_step
from tests.workers.bf16_policy_worker import G, samples


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def one_step(hf_dir: str, ctx, arch, precision: str, variant: dict, rng: dict) -> tuple[float, list, int, bool]:
    """One optimizer step of a policy built from ``rng`` with the ``model.`` keys of ``variant``: its loss, main
    grads, how many weights its fused weight-gradient GEMMs wrote, and whether its torch Adam ran fused."""
    _set_rng_state(rng)
    model = ModelConfig(hf_path=hf_dir, init="random", precision=precision, **variant)
    policy = build_policy(arch, ctx, model, OptimConfig(lr=1e-3, clip_grad=1.0), steps=2)
    batch = samples(arch.vocab_size, prompt=9, response=24)
    adv = compute_group_advantages(torch.tensor([s.reward for s in batch]), G, AdvantageParams())
    mbs = build_microbatches(batch, adv.advantages, adv.sample_valid, G, token_budget=128, device=ctx.device)
    result = policy_step(policy.ddp, policy.optimizer, ctx, mbs, ObjectiveParams(tis_cap=2.0),
                         global_token_count(batch, adv.sample_valid), global_seq_count(adv.sample_valid))
    assert math.isfinite(result.loss) and not result.skipped, result
    params = [p for _, p in sorted(policy.model.named_parameters())]
    # megatron's linears mark the weights whose gradient their fused GEMM added to main_grad
    fused = sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in params)
    torch_adams = [w.optimizer for w in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])]
    fused_adam = all(g["fused"] for opt in torch_adams for g in opt.param_groups)
    return result.loss, [p.main_grad.detach().clone() for p in params], fused, fused_adam


def parse_variant(pairs: list[str]) -> dict:
    """``key=value`` model keys -> ModelConfig fields (true/false as bools)."""
    values = dict(pair.split("=", 1) for pair in pairs)
    return {k: {"true": True, "false": False}.get(v, v) for k, v in values.items()}


def main() -> None:
    hf_dir, precision, variant = sys.argv[1], sys.argv[2], parse_variant(sys.argv[3:])
    ctx = init_parallel(1, 1, 1234)
    arch = load_arch(hf_dir)
    rng = _rng_state()
    eager = one_step(hf_dir, ctx, arch, precision, {"grad_accum_fusion": False}, rng)
    other = one_step(hf_dir, ctx, arch, precision, variant, rng)
    loss = abs(other[0] - eager[0]) / max(abs(eager[0]), 1e-30)
    grads = max(rel(c, e) for c, e in zip(other[1], eager[1]))
    print(f"COMPILED loss={loss:.3e} grads={grads:.3e} fused={other[2]} fused_adam={int(other[3])} "
          f"eager_loss={eager[0]:.6g}", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
