"""A CPU twin of megatron-core's model-parallel RNG tracker.

Megatron's ``CudaRNGStatesTracker`` stores and swaps ``torch.cuda`` generator states; attention and parameter
init fork it (``cuda rng state model-parallel-rng is not added`` otherwise). On CPU the same semantics hold with
the CPU default generator: ``add`` seeds a named state, ``fork`` swaps it in and saves it back on exit.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mp_random


class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
    """Named CPU generator states, forked like megatron's CUDA ones."""

    def add(self, name: str, seed: int) -> None:
        """Create the state ``name`` from ``seed`` without disturbing the current CPU generator."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with the named state as the CPU generator state, then restore the original."""
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def install_cpu_rng_tracker() -> None:
    """Make megatron's global tracker a ``CpuRNGStatesTracker`` (idempotent)."""
    if isinstance(mp_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        return
    mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
