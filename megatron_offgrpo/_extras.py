"""Optional dependencies, each behind a named extra of pyproject.toml: one import that fails with one line naming the
extra to install (the ``offgrpo`` command prints it and exits 2)."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require_extra(module: str, extra: str, needed_by: str) -> ModuleType:
    """Import ``module`` (e.g. ``"wandb"``), or raise ``MissingExtra`` naming ``extra`` (its pyproject.toml extra).

    Args:
        needed_by: what needs it, for the message (``"offgrpo report's plots"``, ``"train.logger=wandb"``).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        why = "is not installed" if exc.name in (module, top) else f"cannot be imported ({exc})"
        raise MissingExtra(f"{needed_by} needs {top}, which {why}: pip install 'megatron-offgrpo[{extra}]' "
                           f"(from a checkout: pip install -e '.[{extra}]')") from exc


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` with the file-only Agg backend (no display needed), from the ``plot`` extra."""
    matplotlib = require_extra("matplotlib", "plot", "plotting")
    matplotlib.use("Agg")
    return require_extra("matplotlib.pyplot", "plot", "plotting")
