"""Argument parsing for ``offgrpo sft`` (supervised warm-up; under torchrun for several processes)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``--config RECIPE [key=value ...]`` and run the warm-up."""
    parser = argparse.ArgumentParser(prog="offgrpo sft", description="Supervised warm-up on the recipe's ground "
                                     "truths; writes train.out_dir/hf for an RL recipe to start from.")
    parser.add_argument("--config", required=True, help="YAML recipe (e.g. configs/tiny-cpu-sft.yaml)")
    parser.add_argument("--verbose", action="store_true", help="also show megatron-core's INFO lines on the console "
                        "(they always go to train.out_dir/train.log)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=300")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    from megatron_offgrpo.runlog import claim_run_dir
    from megatron_offgrpo.preflight import config_or_exit

    config = config_or_exit(args.config, args.overrides, tracking=True,
                            relaunch=["-m", "megatron_offgrpo.cli", "sft", *argv])
    if config.lora.rank:  # the warm-up's product is a whole HF model for RL to start from (with or without LoRA)
        print(f"error: lora.rank={config.lora.rank}: offgrpo sft trains the whole model; set lora.* on offgrpo train",
              file=sys.stderr)
        sys.exit(2)
    lock = claim_run_dir(config, command="sft")  # offgrpo train's rules: never over an earlier run, one writer
    from megatron_offgrpo.runlog import setup_logging

    setup_logging(config.train.out_dir, args.verbose)  # before megatron is imported: its import warns
    from megatron_offgrpo.runtime import tune_cpu_memory
    from megatron_offgrpo.train import run_to_exit, sft

    tune_cpu_memory()  # every step's loss chunks over the vocabulary: pages reused, not faulted
    out = run_to_exit(lambda: sft(config), config.train.out_dir, lock)  # signals, a full disk: one line
    print(f"warm-up model: {out}")


if __name__ == "__main__":
    main()
