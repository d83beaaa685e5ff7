"""A CPU job's checkpoint snapshot for a forked writer: the saved tensors copied, and the trainer's own tensors kept
out of the fork.

A forked writer shares every page of the trainer copy-on-write, so each page the trainer's next step writes while
the writer lives is copied first, whether the writer reads it or not: at the Qwen2.5-0.5B shape on CPU that made the
next optimizer step 6.8 s slower, more than the 5.4 s a synchronous save blocks (measured 2026-11-29). On a GPU the
step writes device memory and megatron's staging copy (device to host) is what the writer reads, so there is no such
cost. ``ForkSnapshot`` gives a CPU job the same shape: it stages a copy of every tensor (megatron's
``preload_fn`` returns the tensors themselves on CPU) and marks the pages that lie wholly inside the originals and
the gradient buffers ``MADV_DONTFORK`` for the one ``fork`` that makes the writer, then shares them again; the
heap's free pages, which the next step's buffers would reuse (``runtime._memory`` keeps them), go back to the kernel
before that fork. The writer maps the copies alone; the trainer's step then writes pages no other process maps.
The writer never touches the originals (a touch would end it with SIGSEGV: a failed save, said on every rank, never
a wrong file).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from typing import Callable, Iterable, Sequence

import torch

from megatron_offgrpo.runtime._memory import release_free_memory

logger = logging.getLogger(__name__)

MADV_DONTFORK, MADV_DOFORK = 10, 11  # linux/mman-common.h


def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # not Linux: the fork shares the pages (slower, the same checkpoint)
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The whole pages inside each distinct CPU storage (the pages at its edges may hold other allocations)."""
    ranges, seen, page = [], set(), mmap.PAGESIZE
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start in seen or storage.device.type != "cpu":
            continue
        seen.add(start)
        first, end = -(-start // page) * page, (start + storage.nbytes()) // page * page
        if end > first:
            ranges.append((first, end - first))
    return ranges


def step_tensors(model, optimizer) -> list[torch.Tensor]:
    """What a training step writes in place: megatron ``model``'s parameters and gradient buffers, and each inner
    optimizer's parameters (fp32 main copies under mixed precision) and state (a save's tensors may be copies)."""
    params = list(model.parameters())
    tensors = params + [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = chained.optimizer
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]
    return tensors


class ForkSnapshot:
    """The host copies a CPU job's background saves are written from: made on the first save, refilled in place by
    the next ones (the previous writer has exited by then), so that only the first save pays for their pages."""

    def __init__(self) -> None:
        self._copies: list[torch.Tensor] = []
        self._advised: list[tuple[int, int]] = []

    def staging(self, preload: Callable[[], list], private: Sequence[torch.Tensor]) -> Callable[[], list]:
        """The ``preload_fn`` for megatron to call right before it forks the writer: ``preload`` (megatron's, which
        returns 0.16's write buckets ``[(file, key, (bytes, [(item, tensor)]))]``) with every tensor copied, the
        originals and ``private`` (``step_tensors``) kept out of that fork."""
        return functools.partial(self._stage, preload, list(private))

    def _stage(self, preload: Callable[[], list], private: list[torch.Tensor]) -> list:
        buckets = preload()
        originals = [tensor for _, _, (_, tensors) in buckets for _, tensor in tensors]
        kept = self._copies
        self._copies = [kept[i].copy_(tensor) if i < len(kept) and _same_layout(kept[i], tensor) else tensor.clone()
                        for i, tensor in enumerate(originals)]
        copies = iter(self._copies)
        staged = [(file, key, (data, [(item, next(copies)) for item, _ in tensors])) for file, key, (data, tensors)
                  in buckets]
        release_free_memory()  # the heap's free pages: the next step's buffers would reuse them, shared with the writer
        madvise = _madvise()
        if madvise is not None:
            ranges = _page_ranges(originals + private)
            self._advised = [(at, size) for at, size in ranges if madvise(at, size, MADV_DONTFORK) == 0]
            if len(self._advised) < len(ranges):
                logger.debug("MADV_DONTFORK refused for %d of %d ranges", len(ranges) - len(self._advised), len(ranges))
        return staged

    def release(self) -> None:
        """After the fork: later forks map those pages again (a synchronous save's writers read them)."""
        madvise = _madvise()
        for at, size in self._advised:
            madvise(at, size, MADV_DOFORK)
        self._advised = []


def _same_layout(copy: torch.Tensor, tensor: torch.Tensor) -> bool:
    return copy.shape == tensor.shape and copy.dtype == tensor.dtype and copy.stride() == tensor.stride()
