"""CPU memory: how torch's large CPU buffers are obtained from the operating system.

Every step allocates large short-lived buffers: a decode step's logits, log-probs and probabilities (3 x 39 MB at
64 rows x 151,936 vocabulary), the fused loss's chunks, a refresh's whole model. glibc's malloc maps each block of
32 MB or more fresh from the kernel and unmaps it on free, so every first touch of every page faults, step after
step. Measured on the 2-core CPU VM: a log-softmax of [64, 151,936] took 13.9 ms into a fresh buffer, 4.7 ms into a
reused one; with transparent huge pages 6.9 ms (fewer faults, each zeroing 2 MB). Three settings, all process-wide:

- transparent huge pages for torch's large buffers (``THP_MEM_ALLOC_ENABLE``, read by torch once);
- glibc serves blocks up to ``HEAP_BYTES`` from its heap and keeps up to that much freed at the heap's top
  (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), so a step reuses the last step's pages: measured
  with ``offgrpo train`` at 8 x 8 x 64 tokens (benchmarks/vs_trl.py's shape), generation 3.5-4.2 -> 2.2 s and the
  optimizer step 4.8-5.0 -> 4.2-4.5 s. The price, memory held that is no longer used, is paid back at each phase's
  end (``release_free_memory``: the trainer calls it after each generation and each optimizer step), so one
  phase's kept buffers do not add to the next one's peak (peak PSS 2.82-3.01 GB without it, 2.49 with, 2.43 before).

- one malloc arena for every thread (``MALLOC_ARENA_MAX``): glibc gives a thread other than the main one an arena of
  its own, whose heaps are at most 64 MiB, so a decode step's 39 MB buffers allocated by the in-process engine's
  loop thread were mapped and unmapped afresh at every step whatever the thresholds; in the main arena they reuse
  its heap. Measured on a 6-step tiny ``offgrpo train`` (in-process vLLM): generation page faults 1.49M -> 0.37M,
  its system time 3.7 -> 1.1 s, its wall time 11.6 -> 9.1 s. The threads that allocate large buffers are few (the
  engine's loop, torch's own), so one arena's lock costs nothing measurable.

A setting the user already made (the variable in the environment) wins. Elsewhere than glibc (macOS, musl) the
malloc part does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import MutableMapping

logger = logging.getLogger(__name__)

THP_ENV = "THP_MEM_ALLOC_ENABLE"
MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"
TRIM_THRESHOLD_ENV = "MALLOC_TRIM_THRESHOLD_"
ARENA_MAX_ENV = "MALLOC_ARENA_MAX"
# above a decode step's buffers (39 MB each at the shapes above); blocks from 256 MiB up (the fused loss's chunk
# buffer, once per micro-batch) are still mapped fresh: 1 GiB measured no faster end to end, and held more
HEAP_BYTES = 256 << 20
# glibc's M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX
_MALLOPT = {TRIM_THRESHOLD_ENV: -1, MMAP_THRESHOLD_ENV: -3, ARENA_MAX_ENV: -8}


def tune_cpu_memory(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Apply the settings to this process (``env`` None; its children inherit them) or to the environment ``env``
    of a child process about to start. Call it at a process's entry, before tensor work (torch reads the huge-page
    variable once) and before threads start (a thread keeps the arena it first allocated from). Returns the
    settings in force.
    """
    target = os.environ if env is None else env
    settings = {name: target.setdefault(name, value) for name, value in
                ((THP_ENV, "1"), (MMAP_THRESHOLD_ENV, str(HEAP_BYTES)), (TRIM_THRESHOLD_ENV, str(HEAP_BYTES)),
                 (ARENA_MAX_ENV, "1"))}
    if env is None:  # glibc read its variables at this process's start: tell it now
        _mallopt({name: settings[name] for name in _MALLOPT})
    return settings


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc's (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def _mallopt(values: dict[str, str]) -> None:
    """Set glibc's thresholds of this process (nothing where malloc is not glibc's)."""
    libc = _glibc()
    if libc is None:
        return
    for name, value in values.items():
        try:
            applied = libc.mallopt(_MALLOPT[name], int(value))
        except ValueError:  # the user's variable is not a number: glibc ignored it too
            applied = 0
        if not applied:
            logger.debug("malloc: %s=%s not applied", name, value)


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``; nothing elsewhere): at the end of a
    phase (a generation, an optimizer step), so that the next phase's peak does not stack on this one's freed
    buffers. The next phase faults its first buffers fresh once, then reuses them again."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
