"""Runtime: device/backend detection, distributed + megatron parallel state, the CPU layer for megatron-core, and
checkpoints written in the background (``BackgroundSave``: megatron-core's asynchronous save in a forked process)."""

from megatron_offgrpo.runtime._background_save import BackgroundSave, SaveFailed
from megatron_offgrpo.runtime._cpu_compat import apply_cpu_compat
from megatron_offgrpo.runtime._device import default_backend, has_cuda, have_te, hide_broken_te, te_status
from megatron_offgrpo.runtime._distributed import ParallelContext, destroy_parallel, init_parallel
from megatron_offgrpo.runtime._memory import release_free_memory, tune_cpu_memory
from megatron_offgrpo.runtime._processes import process_alive
from megatron_offgrpo.runtime._save_queue import use_in_process_save_queue

__all__ = [
    "BackgroundSave",
    "ParallelContext",
    "SaveFailed",
    "apply_cpu_compat",
    "default_backend",
    "destroy_parallel",
    "has_cuda",
    "have_te",
    "hide_broken_te",
    "init_parallel",
    "process_alive",
    "release_free_memory",
    "te_status",
    "tune_cpu_memory",
    "use_in_process_save_queue",
]
