"""The TRL side of ``benchmarks/vs_trl.py``, run as its own process: TRL's GRPOTrainer on the same model, prompts,
reward and shape as ``offgrpo train``, each step timed (generation + scoring, and the rest of the step).

    python benchmarks/_trl_side.py MODEL_DIR PROMPTS_JSON OUT_JSON --steps 4 --group 8 --tokens 64 --lr 1e-6

Also holds the reward both sides use (``length_parity``), importable as ``benchmarks._trl_side:length_parity``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def length_parity(completion: str, answer: str | None = None) -> float:
    """1.0 for a completion of an even number of characters: random-init policies' groups then have variance."""
    return float(len(completion) % 2 == 0)


def trl_reward(completions: list, **kwargs) -> list[float]:
    """``length_parity`` in TRL's reward-function signature (plain-text prompts: completions are strings)."""
    return [length_parity(c) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("prompts_json", help="a JSON list of prompt strings, prompts_per_step x steps of them")
    parser.add_argument("out_json")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts", type=int, required=True, help="prompts per step")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps: list[dict[str, float]] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer whose generation (with scoring and the old log-probs it computes) is timed per step."""

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            steps.append({"generate_s": time.perf_counter() - start,
                          "completion_tokens": int(out["completion_mask"].sum())})
            return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps[-1]["step_s"] = time.perf_counter() - self.start

    prompts = json.loads(Path(args.prompts_json).read_text())
    config = GRPOConfig(
        output_dir=str(Path(args.out_json).parent / "trl_out"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=args.prompts * args.group, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.tokens, temperature=1.0, top_p=1.0,
        steps_per_generation=1, num_iterations=1, beta=0.0, loss_type="dapo", learning_rate=args.lr,
        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", seed=1234,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    torch.manual_seed(1234)
    trainer = TimedGRPOTrainer(model=args.model_dir, reward_funcs=trl_reward, args=config,
                               train_dataset=Dataset.from_dict({"prompt": prompts}), callbacks=[StepClock()])
    trainer.train()
    Path(args.out_json).write_text(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main()
