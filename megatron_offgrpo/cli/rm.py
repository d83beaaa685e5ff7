"""Argument parsing for ``offgrpo rm`` (a scalar reward model fitted to the policy's own labelled samples; one
process, no megatron model)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

LOCAL_PREFIXES = ("/", "./", "../", "~", "runs/")


def _missing_policy(recipe: str, overrides: list[str]) -> str | None:
    """The line for a policy directory that is not there yet (``offgrpo sft`` writes it), or None: a config that
    does not load, or a hub id, is ``config_or_exit``'s to report."""
    from megatron_offgrpo.config import load_config

    try:
        path = load_config(recipe, overrides).model.hf_path
    except Exception:  # noqa: BLE001 -- reported with every other error by config_or_exit next
        return None
    if Path(path).expanduser().is_dir() or not (path.startswith(LOCAL_PREFIXES) or Path(path).parent.is_dir()):
        return None
    return (f"model.hf_path={path}: no such directory; the policy comes first: offgrpo sft --config RECIPE (the "
            "demo's: configs/tiny-cpu-sft.yaml writes runs/tiny-cpu-sft/hf)")


def _refusal(config) -> str | None:
    """What ``offgrpo rm`` cannot do with a valid config."""
    if config.model.init != "hf":
        return (f"model.init={config.model.init}: offgrpo rm builds the classifier from the policy's weights in "
                "model.hf_path; set model.init=hf")
    if config.env.name:
        return (f"env.name={config.env.name!r}: a reward model scores single-turn completions; drop env.name (an "
                "episode is rewarded by its environment)")
    if config.lora.rank:
        return f"lora.rank={config.lora.rank}: offgrpo rm trains the whole classifier; set lora.rank=0"
    return None


def main(argv: list[str] | None = None) -> None:
    """Parse ``--config RECIPE [key=value ...]`` and fit the reward model."""
    parser = argparse.ArgumentParser(prog="offgrpo rm", description="Fit a scalar reward model (a one-label sequence "
                                     "classifier from the policy's weights) to the policy's own completions, labelled "
                                     "by the rule reward; writes train.out_dir/hf and train.out_dir/rm_report.json.")
    parser.add_argument("--config", required=True, help="YAML recipe (e.g. configs/tiny-cpu-rm.yaml)")
    parser.add_argument("--verbose", action="store_true", help="also show the libraries' INFO lines on the console "
                        "(they always go to train.out_dir/train.log)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=100 rm.loss=pairwise")
    args = parser.parse_args(argv)
    if line := _missing_policy(args.config, args.overrides):
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    from megatron_offgrpo.preflight import config_or_exit
    from megatron_offgrpo.runlog import claim_run_dir

    config = config_or_exit(args.config, args.overrides)
    if line := _refusal(config):
        print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    lock = claim_run_dir(config, command="rm")  # offgrpo train's rules: never over an earlier run, one writer
    from megatron_offgrpo.runlog import setup_logging

    setup_logging(config.train.out_dir, args.verbose)  # before transformers and vLLM are imported
    from megatron_offgrpo.rmfit import NoContrastError, fit_reward_model
    from megatron_offgrpo.runtime import tune_cpu_memory
    from megatron_offgrpo.train import run_to_exit

    tune_cpu_memory()

    def fit() -> dict:
        try:
            return fit_reward_model(config)
        except NoContrastError as exc:  # the policy against the task: one line, as a run without learning signal
            sys.exit(f"error: {exc}")

    report = run_to_exit(fit, config.train.out_dir, lock)  # signals, a full disk, an engine that died: one line
    print(f"reward model: {report['model']}")


if __name__ == "__main__":
    main()
