"""torchrun worker: one optimizer step of a LoRA policy (``TrainerSide.learn``: the fused loss, megatron DDP and
optimizer) on fixed samples, at the layout the overrides give. Saves (global rank 0), keyed by layout-free names
(``L<global layer>.<target>.<a|b>``), each adapter factor's whole gradient (its TP shards put together) and whole
updated value, for the test to compare across layouts; checks on every rank that the base weights are bit-identical
after the step and that DDP and the optimizer hold the adapters only.

Before the step every B is set to a fixed random value (drawn whole, then sliced like the rank's shard): at B = 0,
A's gradient is zero and would compare nothing.

argv: OUT (a .pt file), HF_DIR, then config overrides (parallel.tp=2, parallel.pp=2, lora.rank=..., ...).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_offgrpo.config import load_config
from megatron_offgrpo.model import load_arch, lora
from megatron_offgrpo.train._trainer_side import TrainerSide
from tests.workers.sp_step_worker import G, fixed_samples


def _adapters(model) -> list[tuple[str, lora.LoraAdapter]]:
    """(layout-free name, adapter) of every adapted linear of this stage."""
    out = []
    for layer in model.decoder.layers:
        for parent in (layer.self_attention, layer.mlp):
            for target in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
                module = getattr(parent, target, None)
                if module is not None and hasattr(module, lora.ADAPTER):
                    out.append((f"L{layer.layer_number}.{target}", getattr(module, lora.ADAPTER)))
    return out


def _whole(tensor: torch.Tensor, split_dim: int | None, ctx, gated: bool) -> torch.Tensor:
    """The TP1 tensor from this rank's shard. ``gated``: linear_fc1's rows, [gate; up] whole but [gate_r; up_r] on
    rank r (megatron splits each half)."""
    if split_dim is None or ctx.tp_size == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=ctx.tp_group)
    if gated:
        halves = [part.chunk(2, dim=0) for part in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(parts, dim=split_dim)


def _shard(whole: torch.Tensor, ctx, gated: bool) -> torch.Tensor:
    """This rank's rows of a column-parallel TP1 tensor (``_whole``'s inverse)."""
    if gated:
        return torch.cat([half.chunk(ctx.tp_size)[ctx.tp_rank] for half in whole.chunk(2)])
    return whole.chunk(ctx.tp_size)[ctx.tp_rank]


@torch.no_grad()
def _set_b(adapters, ctx) -> None:
    for name, adapter in adapters:
        gen = torch.Generator().manual_seed(sum(map(ord, name)))  # the same draw at every layout
        rows = adapter.weight_b.shape[0] * (ctx.tp_size if adapter.column_parallel else 1)
        whole = torch.randn(rows, adapter.rank, generator=gen, dtype=torch.float64) * 0.05
        if adapter.column_parallel:
            whole = _shard(whole, ctx, name.endswith("linear_fc1"))
        adapter.weight_b.copy_(whole.to(adapter.weight_b.dtype))


def _check_reference(side, model) -> None:
    """The KL reference with LoRA is the trained stage with its adapters off: exactly the stage with B = 0."""
    probe = list(range(3, 40))
    with lora.scored_with(model, None):
        off = side.probe_logprobs(probe)
    kept = {name: p.detach().clone() for name, p in lora.adapter_parameters(model).items()}
    with torch.no_grad():
        for name, param in lora.adapter_parameters(model).items():
            if name.endswith("weight_b"):
                param.zero_()
        zero = side.probe_logprobs(probe)
        for name, param in lora.adapter_parameters(model).items():
            param.copy_(kept[name])
    now = side.probe_logprobs(probe)
    assert off == zero, f"adapters off is not the base: {off[:3]} {zero[:3]}"
    assert off != now or not any(now), "the adapters change nothing"  # log-probs are filled on the rank that reports


def _save_then_step(side, samples, run_dir: Path, hf_dir: str) -> dict:
    """Save a checkpoint after the first step, take a second: what a resumed run must take again exactly."""
    from megatron_offgrpo.train._checkpoint import TrainerState, save_checkpoint
    from megatron_offgrpo.train._weights import model_card

    model, policy = side.policy.model, side.policy
    state = TrainerState(step=1, version=0, scheduler=policy.scheduler.state_dict())
    save_checkpoint(run_dir, model, policy.optimizer, state, card=model_card(model, side.arch, side.ctx, Path(hf_dir)))
    loss = side.learn(samples).metrics["loss"]
    return {"loss": loss, "values": {n: p.detach().clone() for n, p in lora.adapter_parameters(model).items()}}


def _resume_step(side, samples, checkpoint: Path, expected: Path) -> None:
    """A fresh process loads the checkpoint and takes the second step: the same loss, bit-identical adapters."""
    from megatron_offgrpo.train._checkpoint import load_checkpoint, resume_schedule

    model, policy = side.policy.model, side.policy
    state = load_checkpoint(checkpoint, model, policy.optimizer)
    resume_schedule(policy.scheduler, state.scheduler)
    want = torch.load(expected)[side.ctx.rank]
    loss = side.learn(samples).metrics["loss"]
    assert loss == want["loss"], f"loss after resume {loss} != {want['loss']}"
    for name, param in lora.adapter_parameters(model).items():
        assert torch.equal(param, want["values"][name]), f"{name} differs after resume"
    print(f"RESUMED EXACTLY tp={side.ctx.tp_size} pp={side.ctx.pp_size}")


def main() -> None:
    out, hf_dir, *overrides = sys.argv[1:]
    resume = overrides[:1] == ["resume"]  # resume CHECKPOINT EXPECTED: the second half of the exact-resume check
    checkpoint, expected, overrides = (Path(overrides[1]), Path(overrides[2]), overrides[3:]) if resume else (
        None, None, overrides)
    arch = load_arch(hf_dir)
    config = load_config(None, [f"model.hf_path={hf_dir}", "model.init=hf", "rollout.engine=transformers",
                                f"rollout.group_size={G}", "rollout.prompts_per_step=2", "optim.lr=1e-3",
                                "train.deterministic=true", "lora.rank=4", "lora.alpha=8", "algo.kl_beta=0.05",
                                "rollout.behavior_logprobs=recompute", "lora.sync=merged",  # never refreshed
                                f"train.out_dir={Path(out).parent / 'run'}", *overrides])
    side = TrainerSide.build(config)
    model, ctx = side.policy.model, side.ctx
    adapters = _adapters(model)
    _set_b(adapters, ctx)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(f".{lora.ADAPTER}." in n for n, p in model.named_parameters() if p.requires_grad)
    buffer_numel = sum(b.numel_unpadded if hasattr(b, "numel_unpadded") else b.grad_data.numel()
                       for b in side.policy.ddp.buffers)
    samples = fixed_samples(arch.vocab_size, arch.num_layers, 0, 0)
    if resume:
        return _resume_step(side, samples, checkpoint, expected)
    metrics = side.learn(samples).metrics
    for name, before in base_before.items():
        assert torch.equal(before, dict(model.named_parameters())[name]), f"base weight {name} changed"
    state_params = sum(len(opt.optimizer.state) for opt in getattr(side.policy.optimizer, "chained_optimizers",
                                                                   [side.policy.optimizer]))
    _check_reference(side, model)
    grads, values = {}, {}
    for name, adapter in adapters:
        a_dim, b_dim = (None, 0) if adapter.column_parallel else (1, None)
        gated = name.endswith("linear_fc1")
        grads[f"{name}.a"] = _whole(adapter.weight_a.main_grad, a_dim, ctx, False)
        grads[f"{name}.b"] = _whole(adapter.weight_b.main_grad, b_dim, ctx, gated)
        values[f"{name}.a"] = _whole(adapter.weight_a, a_dim, ctx, False)
        values[f"{name}.b"] = _whole(adapter.weight_b, b_dim, ctx, gated)
    second = [None] * dist.get_world_size()
    dist.all_gather_object(second, _save_then_step(side, samples, Path(out).parent / "run", hf_dir))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (grads, values))
    if ctx.rank == 0:
        merged_grads = {k: v for g, _ in gathered for k, v in g.items()}
        merged_values = {k: v for _, v in gathered for k, v in v.items()}
        torch.save({"metrics": metrics, "grads": merged_grads, "values": merged_values,
                    "trained_numel": sum(p.numel() for p in trained), "buffer_numel": buffer_numel,
                    "state_params": state_params}, out)
        torch.save(second, Path(out).with_suffix(".second.pt"))
    print(f"DONE tp={ctx.tp_size} pp={ctx.pp_size} dp={ctx.dp_size} loss={metrics['loss']:.6f}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)
