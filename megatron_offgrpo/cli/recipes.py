"""``offgrpo recipes DIR``: copy the recipes (``configs/*.yaml``) and the launch scripts (``launch/``) into DIR, from
the source checkout or, for an installed wheel, from the copy the wheel ships (``megatron_offgrpo/_recipes``)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from megatron_offgrpo import checkout_root

PACKAGE_DIR = Path(__file__).resolve().parents[1]
PARTS = ("configs", "launch")


def recipes_root() -> Path | None:
    """The directory holding ``configs/`` and ``launch/``: the checkout's root, else the wheel's copy; None when
    neither is there (an editable install whose checkout lost them)."""
    for root in (checkout_root(), PACKAGE_DIR / "_recipes"):
        if root is not None and all((root / part).is_dir() for part in PARTS):
            return root
    return None


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for part in PARTS for p in (root / part).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts)


def copy_recipes(dest: Path, force: bool = False) -> list[Path]:
    """Copy every recipe and launch script into ``dest`` (keeping their ``configs/`` and ``launch/`` folders);
    returns the files written. Existing files are replaced only with ``force``.

    Raises:
        FileNotFoundError: no recipes are installed. FileExistsError: ``dest`` is a file, or a file would be
            replaced without ``force``. OSError: ``dest`` cannot be created or written (before any copy
            when it cannot be created).
    """
    root = recipes_root()
    if root is None:
        raise FileNotFoundError(f"no configs/ and launch/ next to {PACKAGE_DIR} nor in it: reinstall megatron-offgrpo")
    files = _files(root)
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"{dest} is a file: DIR is where configs/ and launch/ go; name a directory")
    dest.mkdir(parents=True, exist_ok=True)  # before any copy: a read-only place, or one under a file, fails here
    if not force and (taken := [f for f in files if (dest / f).exists()]):
        raise FileExistsError(f"{dest / taken[0]} exists ({len(taken)} of the {len(files)} files do): "
                              "--force replaces them")
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dest / f)  # keeps the scripts' executable bit
    return [dest / f for f in files]


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="offgrpo recipes", description=__doc__.splitlines()[0])
    parser.add_argument("dest", metavar="DIR", help="where configs/ and launch/ go (created if missing)")
    parser.add_argument("--force", action="store_true", help="replace files that already exist there")
    args = parser.parse_args(argv)
    try:
        written = copy_recipes(Path(args.dest), args.force)
    except (FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:  # read-only, no permission, under a file: the path and the system's reason
        print(f"error: {exc.filename or args.dest}: {exc.strerror or exc}: choose a directory you can write",
              file=sys.stderr)
        sys.exit(2)
    print(f"{len(written)} files into {args.dest}: " + ", ".join(f"{args.dest}/{part}/" for part in PARTS))


if __name__ == "__main__":
    main()
