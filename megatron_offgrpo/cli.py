"""The ``offgrpo`` command. Each sub-command is a module CLI with its own ``--help``; all flags: docs/cli.md.

    offgrpo train   --config RECIPE [--resume] [key=value ...]     (under torchrun for several processes)
    offgrpo sft     --config RECIPE [key=value ...]                supervised warm-up -> HF directory
    offgrpo eval    --config RECIPE [--model DIR] [--prompts N]    accuracy on the eval split
    offgrpo report  RUN_DIR                                         PNG plots + summary of a run
    offgrpo fleet   start|stop|status ...                          the vLLM generation fleet
    offgrpo convert hf-to-megatron|megatron-to-hf|reshard|roundtrip ...
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "megatron_offgrpo.train.cli_entry",
    "sft": "megatron_offgrpo.train.sft_entry",
    "eval": "megatron_offgrpo.train.evaluate",
    "report": "megatron_offgrpo.train.report",
    "fleet": "megatron_offgrpo.rollout.fleet_cli",
}
CONVERT = {
    "hf-to-megatron": "checkpoint_tools.hf_to_megatron",
    "megatron-to-hf": "checkpoint_tools.megatron_to_hf",
    "reshard": "checkpoint_tools.reshard",
    "roundtrip": "checkpoint_tools.roundtrip",
}


def _usage(message: str) -> None:
    print(__doc__, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``offgrpo COMMAND ...``; unknown names list the valid ones."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    command, rest = argv[0], argv[1:]
    if command == "convert":
        if not rest or rest[0] not in CONVERT:
            _usage(f"unknown convert command {rest[0] if rest else ''!r}; valid: {', '.join(CONVERT)}")
        sys.exit(importlib.import_module(CONVERT[rest[0]]).main(rest[1:]) or 0)
    elif command in COMMANDS:
        sys.exit(importlib.import_module(COMMANDS[command]).main(rest) or 0)  # fleet status: 1 = unhealthy
    else:
        _usage(f"unknown command {command!r}; valid: {', '.join([*COMMANDS, 'convert'])}")


if __name__ == "__main__":
    main()
