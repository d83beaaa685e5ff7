"""Lazy doors: rooms whose names load on first use (``offgrpo train --help`` must not import torch or megatron-core,
and logging is set up before they are imported)."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_door(exports: dict[str, str], whole: tuple[str, ...] = ()) -> Callable[[str], object]:
    """A door's module ``__getattr__`` over ``exports`` (name -> the module that defines it); the names in ``whole``
    are that module itself, exported whole (``"checkpoints": "megatron_offgrpo.runlog._checkpoints"``)."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(name)
        module = importlib.import_module(exports[name])
        return module if name in whole else getattr(module, name)

    return __getattr__
