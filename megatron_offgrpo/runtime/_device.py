"""Device, backend and optional-dependency detection, decided once per process.

Optional GPU dependencies become flags here (megatron-core's ``HAVE_TE`` habit). Transformer Engine is probed in a
subprocess-free but exception-proof way: a TE wheel on a machine without CUDA raises ``RuntimeError`` (not
``ImportError``) at import, and megatron-core's own ``try: import transformer_engine`` does not catch that, so a
broken TE would break ``import megatron.core``. We probe first and, when TE is present but unusable, hide it from
megatron-core before megatron-core is imported (see ``hide_broken_te``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)


def has_cuda() -> bool:
    """True when this process can use a CUDA device."""
    return torch.cuda.is_available()


def default_backend() -> str:
    """The torch.distributed backend for this machine: NCCL with CUDA, gloo otherwise."""
    return "nccl" if has_cuda() else "gloo"


@functools.lru_cache(maxsize=1)
def te_status() -> tuple[bool, str]:
    """Whether Transformer Engine is usable, and why not when it is not.

    Returns:
        ``(usable, reason)``; ``reason`` is empty when usable.
    """
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "transformer_engine is not installed"
    if not has_cuda():
        return False, "transformer_engine is installed but CUDA is not available (TE cannot run on CPU)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # TE raises RuntimeError/OSError, not only ImportError, when its CUDA libs are off
        return False, f"transformer_engine failed to import: {type(exc).__name__}: {exc}"
    return True, ""


def hide_broken_te() -> None:
    """Make an installed-but-unusable TE invisible to megatron-core, so its imports fall back cleanly.

    Must run before the first ``import megatron.core``. Putting ``None`` in ``sys.modules`` makes any later
    ``import transformer_engine`` raise ``ImportError``, which megatron-core catches (``HAVE_TE = False``).
    """
    usable, reason = te_status()
    if usable or importlib.util.find_spec("transformer_engine") is None:
        return
    if "megatron.core.extensions.transformer_engine" in sys.modules:  # where megatron-core decides HAVE_TE
        logger.warning("megatron.core was imported before TE could be hidden; its TE detection may fail")
    for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"):
        sys.modules[name] = None  # type: ignore[assignment]
    logger.warning("Transformer Engine hidden from megatron-core: %s", reason)


def have_te() -> bool:
    """True when the Transformer Engine layer spec can be used."""
    return te_status()[0]
