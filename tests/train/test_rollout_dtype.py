"""``rollout.dtype``: an fp32 trainer generating with a bf16 engine (faster decode on CPUs with bf16 GEMMs). The run
checks each refresh at bf16's probe tolerance and reports the bf16 rounding of the behavior log-probs (the trainer /
engine gap), which truncated IS then corrects."""

from __future__ import annotations

import pytest

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.rollout import have_vllm
from megatron_offgrpo.sampler._builders import verify_tolerance
from tests.train.conftest import metrics, train_proc


def test_auto_follows_the_trainers_precision_and_a_named_dtype_wins():
    assert RolloutConfig().serving_dtype("fp32") == "float32"
    assert RolloutConfig().serving_dtype("bf16") == RolloutConfig().serving_dtype("fp8") == "bfloat16"
    assert RolloutConfig(dtype="bfloat16").serving_dtype("fp32") == "bfloat16"
    assert RolloutConfig(dtype="float32").serving_dtype("bf16") == "float32"
    # the probe is checked at the coarser side's tolerance
    assert verify_tolerance(RolloutConfig(dtype="bfloat16"), "fp32") == verify_tolerance(RolloutConfig(), "bf16")
    assert verify_tolerance(RolloutConfig(), "fp32") < verify_tolerance(RolloutConfig(dtype="bfloat16"), "fp32")


@pytest.mark.multiproc
@pytest.mark.slow
def test_an_fp32_trainer_trains_with_a_bf16_engine(tmp_path):
    engine = "vllm" if have_vllm() else "transformers"  # the transformers engine is the twin where vLLM is missing
    runs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        train_proc(1, out, f"rollout.engine={engine}", f"rollout.dtype={dtype}", "train.steps=2",
                   "algo.tis_cap=2.0")
        runs[dtype] = metrics(out)
    gap = {dtype: max(r["log_ratio_abs_mean"] for r in records) for dtype, records in runs.items()}
    # v = 1, exact weights after every verified refresh: what is left between trainer and engine is the engine's
    # rounding (measured with vLLM: fp32 3.4e-7, bf16 9.1e-4 nats per token on the random-init tiny model)
    assert gap["float32"] < 1e-5 and 100 * gap["float32"] < gap["bfloat16"] < 0.5, gap
    assert all(r["policy_version"] == r["step"] for records in runs.values() for r in records)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.6])  # 1.0: the float32 run above
def test_an_unchanged_policys_ratio_is_one_at_every_allowed_temperature(tmp_path, temperature):
    """Step 0 trains on samples of the weights it holds (v = 1, fp32): the engine's behavior log-probs (vLLM's
    processed log-probs: softmax(logits / temperature)) equal the trainer's to rounding, so every ratio is 1. top_p
    < 1 is refused (tests/test_bad_config.py): there the ratio would be the nucleus's mass."""
    engine = "vllm" if have_vllm() else "transformers"
    train_proc(1, tmp_path, f"rollout.engine={engine}", f"rollout.temperature={temperature}", "train.steps=1")
    (step0,) = metrics(tmp_path)
    assert step0["staleness_max"] == 0 and step0["log_ratio_abs_mean"] < 1e-5, step0["log_ratio_abs_mean"]
    assert step0["clip_fraction"] == 0.0
