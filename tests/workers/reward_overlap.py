"""A reward model scoring each group as it is generated, on the in-process ``VLLMEngine`` (a subprocess: vLLM's
CPU worker patches process-wide torch settings): the samples, rewards and scores equal those of scoring after the
whole round (group b samples with seed + b either way), and both record their scoring seconds.

Usage: python reward_overlap.py WORK_DIR     (exit status 0 and a last line "OK ..." on success)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(work: Path) -> None:
    import torch
    import transformers

    from megatron_offgrpo.data import Prompt, SamplingParams, rewards
    from megatron_offgrpo.reward import RewardMix, RewardModel, RewardSpec
    from megatron_offgrpo.rollout import VLLMEngine
    from megatron_offgrpo.sampler import Rollouts, ScoreTiming
    from tests.reward.models import ASSET, TOKENIZER, classifier_dir

    torch.manual_seed(3)
    policy = work / "policy"
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(ASSET)).save_pretrained(
        policy)
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    model = RewardModel.open(RewardSpec("classifier", str(classifier_dir(work / "rm")), mix=RewardMix(1.0, 0.5)))
    engine = VLLMEngine(policy, dtype="float32", max_model_len=512)
    prompts = [Prompt(f"p{i}", tokenizer.encode(f"What is {i} + {i}?"), f"What is {i} + {i}?", str(2 * i))
               for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=11)
    runs = {}
    for overlap in (True, False):
        timing = ScoreTiming()
        rollouts = Rollouts(engine, tokenizer, rewards.get_reward("math_exact"), reward_model=model, overlap=overlap)
        samples = rollouts(prompts, 4, params, timing=timing)
        assert [s.group_id for s in samples] == [b for b in range(6) for _ in range(4)], overlap
        assert timing.scoring_s > 0 and timing.exposed_s >= 0, timing
        runs[overlap] = samples
    for a, b in zip(runs[True], runs[False]):
        assert a.response_ids == b.response_ids and a.behavior_logprobs == b.behavior_logprobs
        assert a.model_score == b.model_score and a.reward == b.reward and a.gold_reward == b.gold_reward
        assert a.reward == 1.0 * a.gold_reward + 0.5 * a.model_score
    assert len({s.model_score for s in runs[True]}) > 1
    engine.close()
    print(f"OK {len(runs[True])} samples scored alike as generated and after the round")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
