"""Argument parsing for ``offgrpo sft`` (supervised warm-up; under torchrun for several processes)."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``--config RECIPE [key=value ...]`` and run the warm-up."""
    parser = argparse.ArgumentParser(prog="offgrpo sft", description="Supervised warm-up on the recipe's ground "
                                     "truths; writes train.out_dir/hf for an RL recipe to start from.")
    parser.add_argument("--config", required=True, help="YAML recipe (e.g. configs/tiny-cpu-sft.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=300")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from megatron_offgrpo.config import ConfigError, load_config
    from megatron_offgrpo.train.sft import sft

    try:
        config = load_config(args.config, args.overrides)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(f"warm-up model: {sft(config)}")
