"""Benchmark: what scoring by a reward model adds to a step, scored as each group is generated (overlap) or after
the whole round, on CPU, in one table.

Real training steps of the tiny recipe (``configs/tiny-cpu.yaml``: 8 prompts x 8 samples, in-process vLLM engine,
rule reward and the demo's shapes, random weights) for ``--steps`` steps per variant:
- ``rule``: the rule reward alone (what generation costs without a model);
- ``classifier``: a one-label classifier of the policy's shape (``reward.model``) in rank 0's process;
- ``judge``: a causal LM of the policy's shape asked through the yes/no template (``reward.judge``), replying up to
  ``--judge-tokens`` tokens, in rank 0's process;
- ``judge-fleet``: the same judge on a one-server fleet of its own (``reward.fleet``);
each model variant with ``reward.overlap`` true and false. Per variant, over the steps after the first: the median
seconds of generation and scoring (``generate_s``), of scoring (``reward_model_s``, summed over groups), of scoring
left after the round's generation (``reward_model_exposed_s``) and of the step (between two records), and the share
of the step that scoring added (exposed / step). On this machine the engine, the models and the trainer share two
cores; on GPUs a reward fleet has its own.
Writes the table to ``OUT/reward_scoring.md`` and the numbers to ``.json``.

Usage: python benchmarks/reward_scoring.py [--steps 6] [--judge-tokens 8] [--out runs/reward-scoring] [--variants ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._runs import TINY, offgrpo, one_server_fleet, random_model, run_records  # noqa: E402
from benchmarks._tables import write_table  # noqa: E402

TOKENIZER = REPO / "megatron_offgrpo" / "assets" / "qwen2-tokenizer"
VARIANTS = ("rule", "classifier", "judge", "judge-fleet")
COLUMNS = ["reward", "overlap", "generate + score s", "scoring s (summed)", "scoring left after generation s",
           "step s", "share of the step"]


def with_tokenizer(directory: Path) -> Path:
    for path in TOKENIZER.iterdir():
        if path.is_file():
            shutil.copy(path, directory / path.name)
    return directory


def classifier(directory: Path) -> Path:
    """A one-label classifier of the tiny model's shape (random weights, the bundled tokenizer), made once."""
    if not (directory / "config.json").exists():
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(TINY, num_labels=1, pad_token_id=151643,
                                                         architectures=["Qwen2ForSequenceClassification"])
        torch.manual_seed(1)
        transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(directory)
    return with_tokenizer(directory)


def summarise(variant: str, overlap: str, records: list[dict]) -> dict:
    timed = records[1:]
    steps = [b["wall_s"] - a["wall_s"] for a, b in zip(records, records[1:])]
    step = statistics.median(steps)
    exposed = statistics.median(r.get("reward_model_exposed_s", 0.0) for r in timed)
    return {"reward": variant, "overlap": overlap,
            "generate + score s": round(statistics.median(r["generate_s"] for r in timed), 3),
            "scoring s (summed)": round(statistics.median(r.get("reward_model_s", 0.0) for r in timed), 3),
            "scoring left after generation s": round(exposed, 3), "step s": round(step, 2),
            "share of the step": f"{100 * exposed / step:.1f}%"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per variant (the first is not timed)")
    parser.add_argument("--judge-tokens", type=int, default=8, help="reward.judge_max_tokens of the judge variants")
    parser.add_argument("--out", type=Path, default=Path("runs/reward-scoring"), help="runs, the table, the numbers")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    if args.steps < 3:
        parser.error(f"--steps {args.steps}: at least 3 (the first is not timed)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    rm = classifier(out / "classifier")
    judge = with_tokenizer(random_model(out / "judge", seed=2))
    base = ["train", "--config", "configs/tiny-cpu.yaml", "model.init=random", f"model.hf_path={TINY}",
            f"train.steps={args.steps}", "train.eval_every=0", "train.save_every=0", "train.loggers=[]",
            "train.overwrite=true"]
    judge_keys = [f"reward.judge={judge}", f"reward.judge_max_tokens={args.judge_tokens}"]
    state = out / "fleet"
    keys = {"rule": [], "classifier": [f"reward.model={rm}"], "judge": judge_keys,
            "judge-fleet": [*judge_keys, f"reward.fleet={state}"]}
    rows = []
    with one_server_fleet(judge, state, wanted="judge-fleet" in args.variants):
        for variant in args.variants:
            for overlap in ("-",) if variant == "rule" else ("true", "false"):
                run = out / f"{variant}-{overlap}"
                print(f"reward_scoring: {variant} overlap={overlap}", flush=True)
                switch = [] if variant == "rule" else [f"reward.overlap={overlap}"]
                offgrpo(*base, *keys[variant], *switch, f"train.out_dir={run}")
                rows.append(summarise(variant, overlap, run_records(run)))
    write_table(out, "reward_scoring", COLUMNS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
