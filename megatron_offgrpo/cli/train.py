"""Argument parsing for ``offgrpo train`` / ``python -m megatron_offgrpo.train`` (the same flags)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``--config RECIPE [--resume] [key=value ...]`` and train."""
    parser = argparse.ArgumentParser(prog="offgrpo train", description="Off-policy GRPO training (run under torchrun "
                                     "for more than one process).")
    parser.add_argument("--config", help="YAML recipe (configs/*.yaml); defaults apply without one")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint of train.out_dir")
    parser.add_argument("--verbose", action="store_true", help="also show megatron-core's and vLLM's INFO lines on "
                        "the console (they always go to train.out_dir/train.log)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.refresh_every=4")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    from megatron_offgrpo.runlog import claim_run_dir
    from megatron_offgrpo.preflight import config_or_exit

    config = config_or_exit(args.config, list(args.overrides) + (["train.resume=true"] if args.resume else []),
                            tracking=True, relaunch=["-m", "megatron_offgrpo.train", *argv])
    lock = claim_run_dir(config)  # held (rank 0) until this process ends: one writer per run directory
    from megatron_offgrpo.runlog import setup_logging

    setup_logging(config.train.out_dir, args.verbose)  # before megatron is imported: its import warns
    from megatron_offgrpo.runtime import tune_cpu_memory
    from megatron_offgrpo.train import run_to_exit, train

    tune_cpu_memory()  # every step's logits and loss chunks, every refresh's whole model: pages reused, not faulted
    # known causes end with one line (a dead engine: on every rank; a signal: 143 / 130), the lock released
    result = run_to_exit(lambda: train(config), config.train.out_dir, lock)
    if result.summary is not None:  # the logging rank's: once per job, not once per torchrun rank
        print(result.summary)


if __name__ == "__main__":  # `python -m megatron_offgrpo.train`, every torchrun rank: the run is done and closed
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)
