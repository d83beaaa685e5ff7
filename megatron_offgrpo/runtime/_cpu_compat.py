"""The CPU compatibility layer for megatron-core 0.16.x: the only place that patches megatron for CPU.

megatron-core assumes CUDA in a handful of places (listed in docs/design.md, "Patch sites"). Each fix
below names the failure it prevents. All fixes are narrow: none wraps the transformer forward/backward hot path
(a global cuda->cpu torch-function mode measured ~25% slower on tiny steps). ``apply_cpu_compat()`` is explicit,
idempotent, logged, and a no-op when CUDA is available: nothing happens at import time.

Why the fixes are equivalent: on a CUDA machine each patched call allocates on the current CUDA device; here the
only device is the CPU, so allocating there (or treating a CPU fp32 tensor as "the fp32 tensor type") is the
same computation on the device we have.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from megatron_offgrpo.runtime._device import has_cuda

logger = logging.getLogger(__name__)

_APPLIED: list[str] = []
_MODE_DEPTH = [0]  # how many wrapped megatron calls are on the stack
_CPU = torch.device("cpu")


def _to_cpu_device(device: Any) -> Any:
    """Map a CUDA device spec ("cuda", "cuda:0", torch.device("cuda")) to the CPU; leave others alone."""
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaAsCpuMode(TorchFunctionMode):
    """Inside this mode, CUDA allocations land on the CPU and CPU tensors report CUDA tensor types.

    Used only around megatron's optimizer construction and grad-norm/clip helpers, which (a) allocate with a
    literal ``device='cuda'`` and (b) assert ``param.grad.type() == 'torch.cuda.FloatTensor'``.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return func(*args, **kwargs)


def _under_cuda_as_cpu(fn: Callable) -> Callable:
    """Wrap ``fn`` so that it runs inside ``_CudaAsCpuMode``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _MODE_DEPTH[0]:  # already inside (e.g. clip_grads called from step): one mode, not two stacked
            return fn(*args, **kwargs)
        _MODE_DEPTH[0] += 1
        try:
            with _CudaAsCpuMode():
                return fn(*args, **kwargs)
        finally:
            _MODE_DEPTH[0] -= 1

    wrapper.__offgrpo_cpu_compat__ = True  # type: ignore[attr-defined]
    return wrapper


class _TorchWithCpuFactories(types.ModuleType):
    """Stands in for the name ``torch`` inside one megatron module: tensor factories given
    ``device="cuda"`` allocate on the CPU; every other attribute is torch's own."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        if name not in self._FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            return attr(*args, **kwargs)

        return factory


def _swap_torch_name(module: types.ModuleType) -> None:
    if not isinstance(getattr(module, "torch", None), _TorchWithCpuFactories):
        module.torch = _TorchWithCpuFactories()


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """megatron's ``get_default_causal_mask`` (True = masked out), allocated on the CPU."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _cpu_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` without CUDA streams and events.

    On CUDA the split sizes are copied to host numpy there; megatron's copy helper leaves CPU tensors as tensors,
    which ``all_to_all_single`` rejects as split sizes ("incompatible function arguments"): here they become numpy
    at the same point, as on CUDA. CPU work is already in order, so there is nothing to synchronise.
    """
    if self.drop_and_pad or point != self.cuda_dtoh_point:
        return tokens_per_expert
    for name in ("input_splits", "output_splits", "output_splits_tp"):
        value = getattr(self, name)
        if torch.is_tensor(value):
            setattr(self, name, value.numpy())
    return tokens_per_expert


def _gloo_uneven_collectives(mappings: types.ModuleType) -> None:
    """Uneven first-dim gathers and reduce-scatters for gloo, which takes equal-sized tensors only ("ProcessGroupGloo::
    allgather: invalid tensor size"). Megatron uses them where tokens are split unevenly over expert-TP ranks (the
    alltoall dispatcher under sequence parallelism with experts split over TP). The gather pads every part to the
    largest and trims; the reduce-scatter all-reduces the whole tensor and keeps this rank's rows: the same values,
    more bytes (CPU only). Equal splits keep megatron's own calls."""
    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "__offgrpo_cpu_compat__", False):
        return

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        padded = input_.new_zeros((max(output_split_sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in range(group.size())]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].contiguous()

    for fn in (gather_along_first_dim, reduce_scatter_along_first_dim):
        fn.__offgrpo_cpu_compat__ = True
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _patch_moe() -> None:
    """The CUDA (and NCCL) assumptions of megatron-core 0.16's MoE layer (docs/design.md, "Patch sites")."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    # 8. The alltoall dispatcher creates a class-wide `torch.cuda.Stream()` for its device-to-host split copies
    #    when the first MoE layer is built ("torch.cuda.Stream requires CUDA support"), and syncs on its events.
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    dispatcher.cuda_dtoh_stream = "cpu: no streams"  # any non-None value: the constructor skips the creation
    dispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh_and_synchronize
    # 9. (The router's `te_general_gemm` without TE: runtime._local_fallbacks, since GPUs without TE need it too.)
    # 10. `track_moe_metrics` allocates its per-layer buffers with a literal device="cuda".
    _swap_torch_name(moe_utils)
    # 11. Experts split over TP under sequence parallelism gather and reduce-scatter uneven token counts, which gloo
    #     refuses.
    from megatron.core.tensor_parallel import mappings

    _gloo_uneven_collectives(mappings)


def apply_cpu_compat() -> list[str]:
    """Patch megatron-core so that its model, schedules and optimizer run on the CPU. Idempotent.

    Returns:
        The names of the fixes in force (empty on a CUDA machine).
    """
    if has_cuda() or _APPLIED:
        return list(_APPLIED)
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer, grad_scaler
    from megatron.core.optimizer import optimizer as optimizer_mod
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils as transformer_utils

    from megatron_offgrpo.runtime._rng import install_cpu_rng_tracker

    # 1. `torch.cuda.current_device()` is used as an allocation device in rotary embeddings, tensor-parallel
    #    layers/mappings/utils and the global memory buffer; on a CPU build it raises "Torch not compiled with
    #    CUDA enabled". Returning the CPU device makes those allocations land where the model lives.
    torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
    # 2. `torch.cuda.synchronize()` (DDP buffer freeing, timers) raises on a CPU build; CPU work is synchronous.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    # 3. Attention and parameter init fork the model-parallel CUDA RNG tracker ("cuda rng state
    #    model-parallel-rng is not added" otherwise); the CPU tracker keeps the same named, forked states.
    install_cpu_rng_tracker()
    # 4. Literal `device="cuda"` tensor factories: the schedules' total_num_tokens counter and the DDP buffer's
    #    warm-up tensor ("Torch not compiled with CUDA enabled").
    for module in (schedules, param_and_grad_buffer):
        _swap_torch_name(module)
    # 5. The causal mask built when attention_mask is None uses device="cuda".
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    # 6. The optimizer: literal device='cuda' buffers (found_inf, _scale_one, grad-scaler tensors, clip buffers)
    #    and `.type() == 'torch.cuda.FloatTensor'` checks that reject CPU fp32 params/grads ("Wrapped parameters
    #    must be one of torch.cuda.FloatTensor ..." and a failed assert in clip_grad_by_total_norm_fp32).
    mcore_optimizer.get_megatron_optimizer = _under_cuda_as_cpu(mcore_optimizer.get_megatron_optimizer)
    for name in ("clip_grad_by_total_norm_fp32", "get_grad_norm_fp32", "count_zeros_fp32"):
        wrapped = _under_cuda_as_cpu(getattr(clip_grads, name))
        setattr(clip_grads, name, wrapped)
        setattr(optimizer_mod, name, wrapped)
    for module in (grad_scaler, distrib_optimizer):
        _swap_torch_name(module)
    optimizer_classes = [
        c for c in vars(optimizer_mod).values()
        if isinstance(c, type) and issubclass(c, optimizer_mod.MegatronOptimizer)
    ] + [distrib_optimizer.DistributedOptimizer]
    for cls in optimizer_classes:
        for meth in ("step", "load_state_dict"):
            fn = cls.__dict__.get(meth)
            if fn is not None and not getattr(fn, "__offgrpo_cpu_compat__", False):
                setattr(cls, meth, _under_cuda_as_cpu(fn))
    # 7. With tied embeddings and pp > 1, megatron copies the embedding to the last stage at construction through
    #    `weight.data.cuda()` + all-reduce ("Torch not compiled with CUDA enabled"); construction-time only.
    if not getattr(LanguageModule.setup_embeddings_and_output_layer, "__offgrpo_cpu_compat__", False):
        LanguageModule.setup_embeddings_and_output_layer = _under_cuda_as_cpu(
            LanguageModule.setup_embeddings_and_output_layer
        )
    _patch_moe()
    from megatron_offgrpo.runtime._local_fallbacks import apply_local_fallbacks

    apply_local_fallbacks()  # the CPU has neither apex nor TE: megatron's fallbacks, fixed
    _APPLIED.extend(
        [
            "cuda.current_device->cpu",
            "cuda.synchronize->noop",
            "cpu rng tracker",
            "schedules/ddp-buffer cuda factories->cpu",
            "causal mask on cpu",
            "optimizer cuda tensors and type checks->cpu",
            "tied-embedding sync at construction on cpu",
            "moe: alltoall splits without cuda streams, torch router gemm, metrics tracker on cpu",
            "uneven first-dim gather / reduce-scatter on gloo",
        ]
    )
    logger.info("megatron-core CPU compatibility layer applied: %s", ", ".join(_APPLIED))
    return list(_APPLIED)
