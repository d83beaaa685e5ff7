"""torchrun worker for the model/checkpoint tests (gloo, CPU).

Modes:
  logits  for each --hf dir: build this rank's TP/PP stage, load HF weights, run megatron's pipeline schedule
          forward-only on fixed ids, save the TP-gathered logits (last stage, TP rank 0) and the streamed HF export
          of every stage (TP rank 0) into --out.
  dpstep  one optimizer step (megatron DDP + optimizer, Adam, grad clipping) on a fixed global batch split over
          DP ranks; saves the updated parameters from DP rank 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_offgrpo.runtime import init_parallel

BATCH, SEQ = 4, 24


def fixed_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    return ids, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1).contiguous()


def build_stage(hf_dir: Path, ctx):
    from checkpoint_tools import load_hf_into_stage, open_safetensors_dir
    from megatron_offgrpo.model import build_gpt_stage, load_arch, transformer_config

    arch = load_arch(hf_dir)
    # MoE: no load-balancing loss, so that a step on a DP/EP split batch equals the whole batch's (the loss is
    # computed on each rank's own tokens, so with it the two differ by design)
    config = transformer_config(arch, ctx.tp_size, ctx.pp_size, ep=ctx.ep_size, moe_aux_loss_coef=0.0,
                                etp=ctx.expert_tp_size)
    model = build_gpt_stage(arch, config, ctx.is_first_stage, ctx.is_last_stage)
    load_hf_into_stage(model, arch, open_safetensors_dir(hf_dir), ctx.tp_size, ctx.tp_rank, ctx.pp_size, ctx.pp_rank,
                       ctx.ep_size, ctx.ep_rank, ctx.expert_tp_size, ctx.expert_tp_rank)
    return arch, model


def run_schedule(model, ids, pos, forward_only: bool, loss_fn=None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outputs = []

    def forward_step(data_iterator, stage):
        batch_ids, batch_pos = next(data_iterator)
        out = stage(batch_ids, batch_pos, None)

        def loss_func(output):
            outputs.append(output.detach())
            loss = loss_fn(output) if loss_fn is not None else output.sum() * 0.0
            return loss, {}

        return out, loss_func

    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([(ids, pos)]),
        model=[model],
        num_microbatches=1,
        seq_length=ids.shape[1],
        micro_batch_size=ids.shape[0],
        forward_only=forward_only,
    )
    return outputs


def mode_logits(args, ctx) -> None:
    from checkpoint_tools import stream_hf_buckets

    for hf_dir in args.hf:
        hf_dir = Path(hf_dir)
        arch, model = build_stage(hf_dir, ctx)
        model.eval()
        ids, pos = fixed_batch(arch.vocab_size)
        with torch.no_grad():
            outputs = run_schedule(model, ids, pos, forward_only=True)
        if ctx.is_last_stage:
            shard = outputs[0].contiguous()  # [b, s, V/tp]
            parts = [torch.empty_like(shard) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, shard, group=ctx.tp_group)
            if ctx.tp_rank == 0 and ctx.dp_rank == 0:
                torch.save({"ids": ids, "logits": torch.cat(parts, dim=-1)},
                           Path(args.out) / f"{hf_dir.name}.logits.pt")
        exported = {}
        groups = (ctx.ep_group, ctx.expert_tp_group) if arch.is_moe else ()
        for bucket in stream_hf_buckets(model, arch, ctx.pp_size, ctx.pp_rank, ctx.tp_group, 64 * 1024, None, *groups):
            for name, tensor in bucket:
                assert name not in exported, f"{name} exported twice"
                exported[name] = tensor
        if ctx.tp_rank == 0 and ctx.dp_rank == 0:
            assert exported, "TP rank 0 of a stage exported nothing"
            save_file(exported, str(Path(args.out) / f"{hf_dir.name}.export.pp{ctx.pp_rank}.safetensors"))
        elif exported:
            raise AssertionError("a rank other than TP rank 0 of DP rank 0 yielded export buckets")
        dist.barrier()


def mode_dpstep(args, ctx) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    arch, model = build_stage(Path(args.hf[0]), ctx)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(use_distributed_optimizer=args.distributed_optimizer, grad_reduce_in_fp32=True),
        module=model,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=0.05,
                        use_distributed_optimizer=args.distributed_optimizer),
        [ddp],
    )
    # The schedules all-reduce DP grads (and tied-embedding grads across PP) only through this hook.
    model.config.finalize_model_grads_func = finalize_model_grads
    ids, pos = fixed_batch(arch.vocab_size)
    per_rank = BATCH // ctx.dp_size
    ids = ids[ctx.dp_rank * per_rank:(ctx.dp_rank + 1) * per_rank]
    pos = pos[: ids.shape[0]]
    labels = torch.roll(ids, -1, dims=1)

    def ce(logits):  # mean token cross-entropy of this rank's micro-batch; DDP averages over DP ranks
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))

    ddp.zero_grad_buffer()
    opt.zero_grad()
    run_schedule(ddp, ids, pos, forward_only=False, loss_fn=ce)
    success, grad_norm, _ = opt.step()
    assert success, "optimizer step reported failure"
    if ctx.expert_dp_rank == 0:  # DP rank 0, and with EP each rank of its EP group (they hold different experts)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        params["grad_norm"] = torch.tensor([float(grad_norm)])
        save_file(params, str(Path(args.out) / f"dpstep.dp{ctx.dp_size}.ep{ctx.ep_rank}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["logits", "dpstep"], required=True)
    parser.add_argument("--hf", nargs="+", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()
    ctx = init_parallel(args.tp, args.pp, ep=args.ep, etp=args.etp)
    {"logits": mode_logits, "dpstep": mode_dpstep}[args.mode](args, ctx)
    dist.barrier()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
