"""The ``offgrpo`` command. Sub-commands delegate to the module CLIs, which document their own flags.

    offgrpo convert hf-to-megatron --hf DIR --out DIR [--tp T] [--pp P]
    offgrpo convert megatron-to-hf --ckpt DIR --out DIR [--max-shard-size 2GB] [--overwrite]
    offgrpo convert reshard --ckpt DIR --out DIR --tp T --pp P
    offgrpo convert roundtrip [--config DIR] [--tp 2] [--pp 2] [--reshard-tp 1] [--reshard-pp 4] [--dtype bfloat16]
"""

from __future__ import annotations

import sys

_CONVERT = {
    "hf-to-megatron": "checkpoint_tools.hf_to_megatron",
    "megatron-to-hf": "checkpoint_tools.megatron_to_hf",
    "reshard": "checkpoint_tools.reshard",
    "roundtrip": "checkpoint_tools.roundtrip",
}


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``offgrpo GROUP COMMAND ...``; unknown names list the valid ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2 or argv[0] != "convert" or argv[1] not in _CONVERT:
        print(__doc__, file=sys.stderr)
        if len(argv) >= 2 and argv[0] == "convert":
            print(f"error: unknown convert command {argv[1]!r}; valid: {', '.join(_CONVERT)}", file=sys.stderr)
        sys.exit(2)
    import importlib

    importlib.import_module(_CONVERT[argv[1]]).main(argv[2:])


if __name__ == "__main__":
    main()
