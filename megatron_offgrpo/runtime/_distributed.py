"""torch.distributed + megatron ``parallel_state`` from the torchrun environment.

The only module that owns process-group state. Callers get a ``ParallelContext`` with explicit groups and ranks
and pass it on; nothing else reads megatron's globals.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

from megatron_offgrpo.runtime._device import default_backend, has_cuda, hide_broken_te

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """The parallel layout of this process, fixed after ``init_parallel``.

    Attributes:
        rank: global rank. world_size: number of processes.
        tp_rank, tp_size, pp_rank, pp_size, dp_rank, dp_size: ranks and sizes inside each parallel group.
        tp_group, pp_group, dp_group: the process groups (``None`` only in a single-process run).
        device: where this rank's model lives.
        ep_rank, ep_size, ep_group: expert parallelism (MoE): the ranks of one EP group hold different experts of
            every layer. expert_tp_group, expert_tp_rank, expert_tp_size: the group an expert's tensor-parallel
            shards are spread over (default the TP group's size). expert_dp_rank: which replica of this rank's
            experts it holds (0: the copy the weight export reads).
    """

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    tp_group: object
    pp_group: object
    dp_group: object
    device: torch.device
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    expert_tp_group: object = None
    expert_tp_rank: int = 0
    expert_tp_size: int = 1
    expert_dp_rank: int = 0

    @property
    def is_first_stage(self) -> bool:
        """True on the pipeline stage that holds the embedding."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the pipeline stage that holds the output layer and computes the loss."""
        return self.pp_rank == self.pp_size - 1

    def layout(self) -> dict[str, int]:
        """The run's parallel sizes by their config names, as run records and checkpoints write them."""
        return {"tp": self.tp_size, "pp": self.pp_size, "dp": self.dp_size, "ep": self.ep_size,
                "etp": self.expert_tp_size}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (set by torchrun)") from None


def init_parallel(
    tp: int = 1, pp: int = 1, seed: int = 1234, timeout_s: float = 600.0, backend: str | None = None, ep: int = 1,
    etp: int | None = None,
) -> ParallelContext:
    """Initialise torch.distributed (from torchrun's env, or a 1-process group) and megatron's parallel state.

    Args:
        tp: tensor-parallel size. pp: pipeline-parallel size. DP is world_size / (tp * pp).
        ep: expert-parallel size (MoE models). etp: expert-tensor-parallel size (None: tp). Megatron lays the
            experts out as etp x ep x expert-DP x pp = world, so etp x ep must divide world / pp.
        seed: base seed; megatron's model-parallel RNG states are derived from it per TP rank.
        timeout_s: collective timeout. backend: override "gloo"/"nccl" (default: by device).

    Returns:
        The ``ParallelContext`` of this process.

    Raises:
        ValueError: when world_size is not divisible by tp * pp.
    """
    hide_broken_te()
    world_size, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    etp = tp if etp is None else etp
    _check_layout(world_size, tp, pp, ep, etp)
    from megatron.core import parallel_state, tensor_parallel

    device = _prepare_device(local_rank)
    if not dist.is_initialized():
        _init_process_group(rank, world_size, backend or default_backend(), timeout_s)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    ctx = _context_from_megatron(rank, world_size, (tp, pp, ep, etp), device)
    logger.info("parallel layout: %s, rank %d of %d on %s", ctx.layout(), ctx.rank, ctx.world_size, ctx.device)
    return ctx


def _check_layout(world_size: int, tp: int, pp: int, ep: int, etp: int) -> None:
    """Refuse a layout the process count cannot hold, naming the sizes and what to change."""
    if tp < 1 or pp < 1 or world_size % (tp * pp) != 0:
        raise ValueError(
            f"parallel layout tp={tp} x pp={pp} does not divide world_size={world_size}: "
            f"launch tp*pp*dp processes (torchrun --nproc_per_node), or change tp/pp"
        )
    if ep < 1 or etp < 1 or (world_size // pp) % (etp * ep):
        raise ValueError(f"etp={etp} x ep={ep} must divide world_size / pp = {world_size // pp} (the experts' layout "
                         f"is etp x ep x expert-dp x pp): change parallel.ep or the process count")


def _prepare_device(local_rank: int) -> torch.device:
    """This rank's device, with megatron-core's missing pieces filled in for it (runtime's one patch site)."""
    from megatron_offgrpo.runtime._cpu_compat import apply_cpu_compat
    from megatron_offgrpo.runtime._local_fallbacks import apply_local_fallbacks

    if has_cuda():
        torch.cuda.set_device(local_rank)
        apply_local_fallbacks()  # a GPU without apex or TE (apply_cpu_compat applies them on the CPU)
        return torch.device("cuda", local_rank)
    apply_cpu_compat()
    return torch.device("cpu")


def _init_process_group(rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    if "MASTER_PORT" in os.environ:  # torchrun (or the user) set the rendezvous: env:// reads it
        init_method = "env://"
    else:
        # Passed, not written into os.environ: every child process (a test's subprocess, vLLM's engine core)
        # would inherit the port and try to listen on it for its own one-process group (EADDRINUSE).
        port = _free_port() if world_size == 1 else 29500
        init_method = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _context_from_megatron(rank: int, world_size: int, sizes: tuple[int, int, int, int],
                           device: torch.device) -> ParallelContext:
    """The groups and ranks megatron's parallel state holds for ``sizes`` (tp, pp, ep, etp), read once into the
    context callers pass on."""
    from megatron.core import parallel_state as ps

    tp, pp, ep, etp = sizes
    return ParallelContext(
        rank=rank, world_size=world_size,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        tp_group=ps.get_tensor_model_parallel_group(), pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(), device=device,
        ep_rank=ps.get_expert_model_parallel_rank(), ep_size=ep, ep_group=ps.get_expert_model_parallel_group(),
        expert_tp_group=ps.get_expert_tensor_parallel_group(), expert_tp_rank=ps.get_expert_tensor_parallel_rank(),
        expert_tp_size=etp, expert_dp_rank=ps.get_expert_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down megatron's parallel state and the default process group (for tests and clean exits)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
