"""The ``offgrpo`` command (this room's door); each sub-command is a module here with ``main(argv)`` and its own
``--help``; all flags: docs/cli.md.

    offgrpo train   --config RECIPE [--resume] [key=value ...]     (under torchrun for several processes)
    offgrpo sft     --config RECIPE [key=value ...]                supervised warm-up -> HF directory
    offgrpo rm      --config RECIPE [key=value ...]                reward model from labelled samples -> HF dir
    offgrpo eval    --config RECIPE [--model DIR] [--prompts N]    accuracy on the eval split
    offgrpo report  RUN_DIR [RUN_DIR ...] [--x step|wall]          panels + summary of runs, overlaid
    offgrpo config  [--config RECIPE] [key=value ...] | --reference  the resolved config, or every key's docs
    offgrpo fleet   start|stop|status ...                          the vLLM generation fleet
    offgrpo convert hf-to-megatron|megatron-to-hf|roundtrip ...   (offgrpo convert --help)
    offgrpo recipes DIR                                             copy configs/ and launch/ into DIR
    offgrpo --version                                               version, git commit, where the recipes are
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import NoReturn

from megatron_offgrpo import MissingExtra, describe
from megatron_offgrpo._megatron_import import missing_megatron

COMMANDS = {
    "train": "megatron_offgrpo.cli.train",
    "sft": "megatron_offgrpo.cli.sft",
    "rm": "megatron_offgrpo.cli.rm",
    "eval": "megatron_offgrpo.cli.eval",
    "report": "megatron_offgrpo.cli.report",
    "fleet": "megatron_offgrpo.cli.fleet",
    "config": "megatron_offgrpo.cli.config",
    "recipes": "megatron_offgrpo.cli.recipes",
}
# The sub-commands that end holding torch, megatron and vLLM: run as the process's entry, they end it with end_process
HEAVY = ("train", "sft", "rm", "eval", "convert")
CONVERT = {  # sub-command: (module, what it does); the descriptions print without importing torch
    "hf-to-megatron": ("checkpoint_tools.hf_to_megatron", "HF Qwen directory -> megatron dist checkpoint (any "
                       "TP/PP/EP loads it)"),
    "megatron-to-hf": ("checkpoint_tools.megatron_to_hf", "megatron checkpoint of any layout -> HF directory"),
    "roundtrip": ("checkpoint_tools.roundtrip", "HF -> megatron dist checkpoint -> HF on the embedded default, "
                  "verified"),
}


def version_text() -> str:
    """``offgrpo --version``: the version and git commit, then where the recipes are."""
    from megatron_offgrpo.cli.recipes import recipes_root

    root = recipes_root()
    where = f"{root}/{{configs,launch}} (offgrpo recipes DIR copies them)" if root else "not installed"
    return f"offgrpo {describe()}\nrecipes: {where}"


def convert_help() -> str:
    """``offgrpo convert``'s usage: each sub-command with its one-line description."""
    width = max(map(len, CONVERT))
    rows = [f"  {name:<{width}}  {text}" for name, (_, text) in CONVERT.items()]
    return "\n".join(["usage: offgrpo convert SUB [ARGS ...]   (offgrpo convert SUB --help: its flags)", "", *rows])


def _usage(message: str) -> None:
    print(__doc__, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _convert(rest: list[str]) -> int:
    """Run ``offgrpo convert SUB ...``; its exit status."""
    if rest and rest[0] in ("-h", "--help"):
        print(convert_help())
        return 0
    if not rest:
        print(convert_help(), file=sys.stderr)
        print("error: name a convert sub-command", file=sys.stderr)
        sys.exit(2)
    if rest[0] not in CONVERT:
        _usage(f"unknown convert command {rest[0]!r}; valid: {', '.join(CONVERT)}")
    return importlib.import_module(CONVERT[rest[0]][0]).main(rest[1:]) or 0


def end_process(code: int) -> NoReturn:
    """End this process with exit status ``code`` now: the ``atexit`` handlers run (logging's flush, the libraries'
    own) and the standard streams are flushed, but the interpreter does not tear its modules down one object at a
    time. After ``offgrpo train`` that teardown (torch, megatron-core, vLLM, transformers) took 2 s of a 1-step tiny
    run's 30, and 3.5 s on the loaded 2-core CI machine, in every process of every job (measured 2026-11-26). Only for
    a process whose work is done: its files, exports and checkpoints written and closed, its engine stopped, its run
    directory's lock released."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``offgrpo COMMAND ...``; unknown names list the valid ones. Without ``argv`` this is the process's
    entry (the ``offgrpo`` script, ``python -m megatron_offgrpo.cli``), and a ``HEAVY`` sub-command that returns ends
    the process with ``end_process``; with it (a caller in the same process) it returns or raises as usual."""
    entry = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] in ("-V", "--version"):
        print(version_text())
        return
    command, rest = argv[0], argv[1:]
    try:
        if command == "convert" or command in COMMANDS:
            code = (_convert(rest) if command == "convert" else
                    importlib.import_module(COMMANDS[command]).main(rest) or 0)  # fleet status: 1 = unhealthy
            if entry and command in HEAVY:
                end_process(code)
            sys.exit(code)
        else:
            _usage(f"unknown command {command!r}; valid: {', '.join([*COMMANDS, 'convert'])}")
    except MissingExtra as exc:  # an optional dependency (plot, tensorboard, wandb, ...): one line names its extra
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except ModuleNotFoundError as exc:  # megatron-core, in an environment without the trainer extra (a fleet's)
        line = missing_megatron(exc)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
