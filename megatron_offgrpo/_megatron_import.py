"""megatron-core is imported the way this machine needs it, whichever module of the project imports it first.

Two things must happen before megatron-core's first import, and only then:
- an installed-but-unusable Transformer Engine is hidden (``runtime.hide_broken_te``: megatron-core's own
  ``try: import transformer_engine`` does not catch the RuntimeError a TE wheel raises on a machine without CUDA);
- on a machine without CUDA, megatron-core's ``jit_fuser`` (``torch.compile``, applied as a decorator at import to its
  fused helpers: bias-SwiGLU/GeLU, bias-dropout-add, router scores) stays the plain function. Decorating imports
  dynamo and inductor (2.4 s of a 9 s import, measured on the 2-core CPU) in every trainer, worker and test
  process, for helpers the model's config mostly turns off (``bias_activation_fusion=False``, ...), and a CPU run
  gains nothing from compiling the rest. With CUDA nothing changes: megatron-core's fusions stay compiled.
  (megatron-core also imports wandb when installed, 1 s; a lazily loaded wandb does not stay lazy: torch's
  ``inspect.getmodule`` walks every module's ``__file__`` at import, so it is left alone.)

``install()`` (run by the package's ``__init__``) puts a finder on ``sys.meta_path`` that wraps the loader of
``megatron.core`` once: the preparation runs around the execution of ``megatron/core/__init__.py``, inside which
megatron-core imports its fusions. Nothing here imports torch before megatron-core is imported.

megatron-core comes with the ``trainer`` extra (the fleet's environment has none): where it is missing, the
``offgrpo`` command turns the import's ModuleNotFoundError into one line naming that extra (``missing_megatron``;
the finder itself stays silent, since libraries probe for ``megatron`` with ``find_spec``). A version other than the
tested one is imported as it is, after one line saying so: a NeMo or Megatron-LM image's newer megatron-core is not
downgraded, and whatever differs is the user's to judge.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import sys
from collections.abc import Iterator
from types import ModuleType


TESTED_MEGATRON_CORE = "0.16.1"


def _eager(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing: ``@torch.compile`` and ``torch.compile(fn)`` return ``fn``."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def prepared() -> Iterator[None]:
    """The state megatron-core's first import needs on this machine (see the module's docstring)."""
    import torch

    from megatron_offgrpo.runtime import has_cuda, hide_broken_te

    hide_broken_te()
    if has_cuda():
        yield
        return
    compile_ = torch.compile
    torch.compile = _eager
    try:
        yield
    finally:
        torch.compile = compile_


class _PreparedLoader(importlib.abc.Loader):
    """``megatron.core``'s own loader, executing the package inside ``prepared()``."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the package keeps its real loader afterwards
        with prepared():
            self.loader.exec_module(module)
        untested = version_note(_installed_megatron_core())
        if untested:
            logging.getLogger("megatron_offgrpo").warning(untested)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` as the path finder does, with its loader wrapped; steps aside after the first time."""

    def find_spec(self, name, path, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _PreparedLoader(spec.loader)
        return spec


def _installed_megatron_core() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on PYTHONPATH: no metadata to compare
        return None


def version_note(version: str | None) -> str | None:
    """The one line for a megatron-core other than the tested one (None for the tested one, or no metadata)."""
    if version is None or version == TESTED_MEGATRON_CORE:
        return None
    return (f"megatron-core {version} is installed; megatron-offgrpo is tested with {TESTED_MEGATRON_CORE} "
            "(kept as installed: the checkpoint format and the layer specs are megatron-core's)")


def missing_megatron(exc: ModuleNotFoundError) -> str | None:
    """The one line for an import that failed because megatron-core is not installed (None for any other module)."""
    if exc.name not in ("megatron", "megatron.core"):
        return None
    return ("megatron-core is not installed, and the trainer and the conversions need it: pip install "
            "'megatron-offgrpo[trainer]' (from a checkout: pip install -e '.[trainer]')")


def install() -> None:
    """Prepare megatron-core's first import in this process (a no-op once it is imported or the finder is there)."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())
