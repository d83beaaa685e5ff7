"""Pins the torch already installed, so that no later pip install can replace it (a pip constraints file).

    python launch/torch_constraints.py torch-constraints.txt
    pip install --constraint torch-constraints.txt -e ".[trainer,plot,tensorboard]"

Writes ``name==version`` for every installed package of the torch stack (torch, torchvision, torchaudio, triton,
Transformer Engine, apex, flash-attn, NVIDIA's CUDA libraries): under ``--constraint``, an install that would change
one of them (an extra such as ``vllm`` that pins another torch, or pip resolving a CUDA torch from PyPI) fails
instead. Refuses (exit 1) when no torch is installed: torch is never pulled in implicitly, install the build that
fits the machine first. Standard library only: it runs before the project is installed (the Makefile's set-up does).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import sys
from pathlib import Path
from typing import Iterable

# What a CUDA torch is built with, by normalized distribution name (PEP 503).
STACK = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton(-[a-z0-9]+)?|transformer-engine(-[a-z0-9-]+)?"
                   r"|apex|flash-attn|nvidia-[a-z0-9-]+)$")
NO_TORCH = ("no torch is installed in this environment: install the torch build for this machine first (CPU: "
            "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; a cluster: its image's or "
            "module's CUDA torch), then run this again; megatron-offgrpo never lets pip choose one")


def normalize(name: str) -> str:
    """PEP 503's normalized form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(installed: Iterable[tuple[str, str]]) -> list[str]:
    """``name==version`` of the torch stack among ``installed`` (name, version) pairs, sorted; the first of a name
    wins (as on sys.path).

    Raises:
        LookupError: torch is not among them.
    """
    found: dict[str, str] = {}
    for name, version in installed:
        key = normalize(name)
        if STACK.match(key):
            found.setdefault(key, version)
    if "torch" not in found:
        raise LookupError(NO_TORCH)
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def installed_distributions() -> list[tuple[str, str]]:
    """(name, version) of every distribution this interpreter sees."""
    return [(d.metadata["Name"], d.version) for d in md.distributions() if d.metadata["Name"]]


def main(argv: list[str] | None = None) -> int:
    """Write the constraints file; 1 when there is no torch to pin."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the constraints file to write (pip install --constraint OUT ...)")
    args = parser.parse_args(argv)
    try:
        lines = pins(installed_distributions())
    except LookupError as exc:
        print(f"torch_constraints: {exc}", file=sys.stderr)
        return 1
    args.out.write_text("# The torch stack of this environment, pinned: pip install --constraint THIS_FILE ...\n"
                        + "".join(line + "\n" for line in lines))
    print(f"torch_constraints: {args.out} pins {', '.join(lines[:3])}" + (f" and {len(lines) - 3} more"
                                                                            if len(lines) > 3 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
