"""``offgrpo eval``: accuracy of a HF model directory on the recipe's eval split, through a local engine or the fleet.

    offgrpo eval --config configs/tiny-cpu.yaml [--model DIR] [--prompts 200] [--samples 8] [--engine transformers]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _out_error(out: Path) -> str | None:
    """Why the JSON result cannot be written to ``out``, or None."""
    if long := next((part for part in out.parts if len(part.encode()) > 255), None):  # first: stat() would raise
        return f"the name {long[:40]}... is {len(long.encode())} bytes, over the 255 a file name may have"
    if out.is_dir():
        return f"is a directory: name the file to write, e.g. --out {out / 'eval.json'}"
    parent = out.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        return f"its directory {parent} {what}: create it first, or choose another --out"
    return None


def main(argv: list[str] | None = None) -> None:
    """Entry point (one process; no megatron model is built)."""
    parser = argparse.ArgumentParser(prog="offgrpo eval", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML recipe (data, reward, sampling length)")
    parser.add_argument("--model", help="HF model directory (default: model.hf_path of the recipe)")
    parser.add_argument("--prompts", type=int, default=None,
                        help="number of eval prompts (default: train.eval_prompts)")
    parser.add_argument("--samples", type=int, default=None,
                        help="completions per prompt besides the greedy one; > 1 adds pass@k and avg@n "
                             "(default: train.eval_samples)")
    parser.add_argument("--engine", default=None, help="transformers | vllm | fleet | auto (default: rollout.engine)")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    if args.out is not None and (error := _out_error(Path(args.out))):  # before minutes of evaluation
        print(f"error: --out {args.out}: {error}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    from megatron_offgrpo.config import ConfigError
    from megatron_offgrpo.data import rewards
    from megatron_offgrpo.envs import EnvironmentContractError, EnvironmentTimeout
    from megatron_offgrpo.model import resolve_model_dir
    from megatron_offgrpo.runtime import tune_cpu_memory
    from megatron_offgrpo.sampler import Rollouts, env_factory, evaluate
    from megatron_offgrpo.sampler import make_rollout_engine
    from megatron_offgrpo.preflight import config_or_exit
    from megatron_offgrpo.model import load_tokenizer
    from megatron_offgrpo.sampler import build_prompts, load_data, log_data

    # the flags are config keys too: validated with the recipe (an unknown engine, --prompts 0: one line, exit 2)
    flags = [f"rollout.engine={args.engine}"] * (args.engine is not None) + [f"train.eval_prompts={args.prompts}"] * (
        args.prompts is not None) + [f"train.eval_samples={args.samples}"] * (args.samples is not None)
    config = config_or_exit(args.config, [*args.overrides, *flags], args.model)
    model = resolve_model_dir(args.model or config.model.hf_path)
    tokenizer = load_tokenizer(model)
    data = load_data(config)
    prompts = build_prompts(config, tokenizer, data.eval[: config.train.eval_prompts])
    report = log_data(config, data)
    positions = json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    # the run's engine, sized like the run's (model length, dtype, KV cache): what serves the policy in training
    reward_fn = rewards.get_reward(config.data.reward)
    try:
        make_env = env_factory(config, reward_fn)  # env.name: episodes, checked before the engine starts
    except (ValueError, EnvironmentContractError, EnvironmentTimeout) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    tune_cpu_memory()  # as in training: every decode step's logits reuse pages, not fault fresh ones
    try:
        engine = make_rollout_engine(config, Path(model), None, positions)
    except ConfigError as exc:  # an engine asked for that cannot serve this model (rollout.engine=vllm)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        rollouts = Rollouts.build(config, engine, tokenizer, reward_fn, make_env)
        result = evaluate(rollouts, prompts, config.rollout.max_new_tokens, samples=config.train.eval_samples,
                          temperature=config.rollout.temperature, seed=config.parallel.seed)
    except (EnvironmentTimeout, EnvironmentContractError) as exc:  # the environment's: one line (its own: a traceback)
        sys.exit(f"error: {exc}")
    finally:
        engine.close()
    result.update(model=str(model), split=config.data.eval_split, dataset=config.data.name,
                  eval_source=report["eval_source"], eval_overlap=report["eval_overlap"])
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
