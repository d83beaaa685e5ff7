"""Checks the container image against the project: run by the Dockerfile at build time, and on a GPU node with --gpu.

    python launch/check_image.py --torch-version-file /opt/offgrpo/torch-version          # build (no GPU)
    python launch/check_image.py --torch-version-file /opt/offgrpo/torch-version --gpu    # on a GPU node

Build checks (metadata only: Transformer Engine cannot be imported without a GPU): torch is still the base image's
build (recorded before any pip install) and a CUDA build; Transformer Engine's version lies in the range of the
project's ``te`` extra (the range megatron-core supports); apex is installed. ``--gpu`` also imports TE and
checks that the trainer will pick the TE layer spec. Exits 1 naming every failed check.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

TE_DISTRIBUTIONS = ("transformer_engine", "transformer-engine")


def te_requirement(project: str = "megatron-offgrpo") -> Requirement:
    """The Transformer Engine requirement of the installed project's ``te`` extra, read from its metadata (the image
    installs the project before this runs): no TOML parser, so Python 3.10 images run it too."""
    def in_te_extra(spec: str) -> bool:
        requirement = Requirement(spec)
        return (requirement.name.replace("_", "-") == "transformer-engine" and requirement.marker is not None
                and requirement.marker.evaluate({"extra": "te"}))

    (spec,) = [spec for spec in md.requires(project) or () if in_te_extra(spec)]
    return Requirement(spec.partition(";")[0])  # without its `extra == "te"` marker


def te_version_problem(installed: str | None, requirement: Requirement) -> str | None:
    """Why ``installed`` (a TE version, None = absent) does not fit ``requirement``; None when it fits."""
    if installed is None:
        return "Transformer Engine is not installed: use NVIDIA's PyTorch container as the base image"
    # NGC builds carry a local label (2.10.0+abc123); compare the release itself.
    if not requirement.specifier.contains(Version(installed).base_version, prereleases=True):
        return (f"Transformer Engine {installed} is outside the te extra's range {requirement.specifier} "
                "(megatron-core's): pick a base image whose TE fits, or move both pins together")
    return None


def _installed(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def build_problems(torch_version_file: Path) -> list[str]:
    """Every failed build-time check (empty: the image is as intended)."""
    import torch

    problems = []
    recorded = torch_version_file.read_text().strip()
    if torch.__version__ != recorded:
        problems.append(f"torch is {torch.__version__}, the base image had {recorded}: a pip install replaced it")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is not a CUDA build")
    te = te_version_problem(_installed(TE_DISTRIBUTIONS), te_requirement())
    if te:
        problems.append(te)
    if importlib.util.find_spec("apex") is None:
        problems.append("apex is not installed (megatron-core falls back to slower torch optimizers and norms)")
    return problems


def gpu_problems() -> list[str]:
    """Runtime checks that need a GPU: TE imports and the trainer picks its layer spec."""
    from megatron_offgrpo.runtime import have_te, te_status

    return [] if have_te() else [f"the trainer cannot use Transformer Engine: {te_status()[1]}"]


def main(argv: list[str] | None = None) -> int:
    """Run the checks; 0 when all pass."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-version-file", type=Path, required=True, help="torch.__version__ of the base image")
    parser.add_argument("--gpu", action="store_true", help="also import TE (needs a GPU)")
    args = parser.parse_args(argv)
    problems = build_problems(args.torch_version_file) + (gpu_problems() if args.gpu else [])
    for problem in problems:
        print(f"check_image: {problem}", file=sys.stderr)
    if not problems:
        print("check_image: torch kept, Transformer Engine in range, apex present"
              + (", TE usable" if args.gpu else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
