"""Worker: where one training step makes the host wait for the device (``train._step``'s promise: never from the
first forward to the end of the backward; the step's metrics read once; megatron's optimizer step once, its clip
reading the grad norm).

CPU (``cpu``): a torch-function mode counts the calls that synchronise on CUDA (``item``, ``tolist``, ``bool``/
``float``/``int`` of a tensor, ``nonzero`` and the other calls whose output size depends on values, a tensor built
from tensors, a boolean-mask index). On CPU nothing waits, so the mode stands in for CUDA's own check; its GPU twin
(``cuda``) runs the same step under ``torch.cuda.set_sync_debug_mode``: "error" over the backward, "warn" (counted)
over the read and the optimizer step. Prints ``SYNCS backward=<n> read=<n> optimizer=<n> local_l2=<n>``, the last
the optimizer step's count with megatron's own local ``multi_tensor_l2norm`` put back (what the replacement saves).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch
from torch.overrides import TorchFunctionMode

from megatron_offgrpo.algo import AdvantageParams, ObjectiveParams, compute_group_advantages
from megatron_offgrpo.config import ModelConfig, OptimConfig
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import destroy_parallel, init_parallel
from megatron_offgrpo.train._batch import build_microbatches, global_seq_count, global_token_count
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._step import _read_once, backward_pass
from tests.workers.bf16_policy_worker import G, samples
T = torch.Tensor
_ALWAYS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.nonzero, torch.nonzero, T.argwhere,
           torch.argwhere, T.masked_select, torch.masked_select, T.unique, torch.unique, torch.unique_consecutive,
           T.cpu, T.numpy}


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would make the host wait for a CUDA device, by the name of the call. ``host``: ids of
    tensors that stay on the CPU on a CUDA run too (reading them waits for nothing)."""

    def __init__(self, host: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        on_host = bool(args) and id(args[0]) in self.host
        waits = (func in _ALWAYS and not on_host) or self._mask_index(func, args)
        self.calls += [getattr(func, "__name__", str(func))] * (self._from_tensors(func, args) or int(waits))
        return func(*args, **kwargs)

    @staticmethod
    def _from_tensors(func, args) -> int:
        """A tensor built from a list of tensors reads each of them: one wait each on CUDA."""
        data = args[0] if args else None
        if func not in (torch.tensor, torch.as_tensor) or not isinstance(data, (list, tuple)):
            return 0
        flat = [y for x in data for y in (x if isinstance(x, (list, tuple)) else [x])]
        return sum(isinstance(x, torch.Tensor) for x in flat)

    @staticmethod
    def _mask_index(func, args) -> bool:
        index = args[1] if func is T.__getitem__ and len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in parts)


class CudaSyncs:
    """``torch.cuda.set_sync_debug_mode`` over a block: "error" raises at the first synchronising call; "warn"
    counts them."""

    def __init__(self, mode: str) -> None:
        self.mode, self.calls = mode, []

    def __enter__(self):
        self._caught = warnings.catch_warnings(record=True)
        self._records = self._caught.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        self._caught.__exit__(*exc)
        self.calls = [str(w.message) for w in self._records if "synchroniz" in str(w.message)]
        return False


def main() -> None:
    hf_dir, device = sys.argv[1], sys.argv[2]
    ctx = init_parallel(1, 1, 1234)
    arch = load_arch(hf_dir)
    policy = build_policy(arch, ctx, ModelConfig(hf_path=hf_dir, init="random",
                                                 precision="bf16" if device == "cuda" else "fp32"),
                          OptimConfig(lr=1e-4, clip_grad=1.0), steps=4)
    batch = samples(arch.vocab_size, prompt=9, response=24)
    adv = compute_group_advantages(torch.tensor([s.reward for s in batch]), G, AdvantageParams())
    mbs = build_microbatches(batch, adv.advantages, adv.sample_valid, G, token_budget=128, device=ctx.device)
    for mb in mbs:  # the fleet's log-probs differ from the behavior ones: the TIS path and its extremes run
        mb.fleet_logp = mb.behavior_logp + 0.2 * torch.randn_like(mb.behavior_logp)
    counts = (global_token_count(batch, adv.sample_valid), global_seq_count(adv.sample_valid))
    params = ObjectiveParams(tis_cap=2.0)
    host_scalars: set[int] = set()  # torch's Adam keeps each parameter's step count on the CPU, on CUDA runs too
    watch = (lambda mode: CudaSyncs(mode)) if device == "cuda" else (lambda mode: SyncCounter(frozenset(host_scalars)))

    def step(local_l2: bool = False) -> dict[str, int]:
        policy.optimizer.zero_grad()
        with watch("error") as backward:
            loss, totals = backward_pass(policy.ddp, ctx, mbs, params, *counts)
        with watch("warn") as read:
            loss_value, metrics = _read_once(loss, totals)
        assert math.isfinite(loss_value) and metrics["tis_raw_max"] > 1, (loss_value, metrics)
        with watch("warn") as optimizer:
            policy.optimizer.step()
        return {"backward": len(backward.calls), "read": len(read.calls), "optimizer": len(optimizer.calls)}

    step()  # warm-up: lazy buffers, first-call compilation, the optimizer's state
    for inner in getattr(policy.optimizer, "chained_optimizers", [policy.optimizer]):
        host_scalars.update(id(state["step"]) for state in inner.optimizer.state.values() if "step" in state)
    found = step()
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    ours, clip_grads.l2_norm_impl = clip_grads.l2_norm_impl, utils.local_multi_tensor_l2_norm
    found["local_l2"] = step()["optimizer"]
    clip_grads.l2_norm_impl = ours
    print("SYNCS " + " ".join(f"{k}={v}" for k, v in found.items()), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
