"""CPU memory: transparent huge pages for torch's large buffers."""

from __future__ import annotations

import os
from typing import MutableMapping

THP_ENV = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages(env: MutableMapping[str, str] | None = None) -> None:
    """Let torch's CPU allocator back large buffers with transparent huge pages, unless ``THP_MEM_ALLOC_ENABLE``
    is already set (the user's choice wins).

    Conversions and weight refreshes allocate GBs of short-lived buffers; with 4 KiB pages every first touch
    faults (measured on the 2-core CPU VM: 0.2-1 s per 512 MB), with huge pages ~0.04 s. torch reads the variable
    once, so call this at a process's entry before tensor work, or pass the environment of a child process.
    """
    (os.environ if env is None else env).setdefault(THP_ENV, "1")
