"""The interface around the chunk loop: argument errors, impl choice, chunk sizing, vocab_parallel_logprobs."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_offgrpo.algo import ObjectiveParams
from megatron_offgrpo.kernels import (
    DEFAULT_CHUNK_BYTES,
    default_chunk_size,
    fused_linear_grpo_loss,
    resolve_impl,
    vocab_parallel_logprobs,
)
from tests.kernels._cases import make_case


def call(case, **overrides):
    args = dict(hidden=case.hidden, weight=case.weight, targets=case.targets, behavior_logp=case.behavior_logp,
                advantages=case.advantages, loss_mask=case.loss_mask, params=case.params)
    kwargs = dict(case.kwargs)
    for key, value in overrides.items():
        (args if key in args else kwargs)[key] = value
    return fused_linear_grpo_loss(**args, **kwargs)


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"hidden": torch.zeros(72, 16, 1)}, r"hidden has shape \(72, 16, 1\); it must be 2-D"),
        ({"weight": torch.zeros(16, 48)}, r"weight must be \[V/tp, H\] with the same H"),
        ({"weight": torch.zeros(48, 16, dtype=torch.float64)}, "cast one to the other"),
        ({"targets": torch.zeros(72)}, "targets has dtype torch.float32; it must hold integer token ids"),
        ({"targets": torch.zeros(71, dtype=torch.long)}, r"targets has shape \(71,\); it must be \[N\] with N=72"),
        ({"targets": torch.full((72,), 48)}, r"targets of valid tokens span \[48, 48\] but the vocabulary"),
        ({"temperature": 0.0}, "temperature=0.0 must be a number > 0"),
        ({"chunk_size": 0}, "chunk_size=0 must be None"),
        ({"impl": "cuda"}, "impl='cuda' is not one of"),
        ({"loss_mask": torch.ones(72)}, "loss_mask has dtype torch.float32; it must be torch.bool"),
        ({"advantages": torch.zeros(5)}, "advantages has 5 entries but the token axis"),
        ({"params": ObjectiveParams(kl_beta=0.1), "ref_logp": None}, "kl_beta=0.1 needs ref_logp"),
        ({"params": ObjectiveParams(tis_cap=2.0)}, "tis_cap=2.0 needs fleet_logp"),
        ({"fleet_logp": torch.zeros(72), "tis_weights": torch.ones(72)}, "pass either fleet_logp"),
        ({"params": ObjectiveParams(aggregation="seq_mean_token_mean"), "seq_ids": None},
         "pass exactly one of seq_ids or cu_seqlens"),
        ({"tp_group": object()}, "torch.distributed is not initialised"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(overrides, match):
    with pytest.raises(ValueError, match=match):
        call(make_case(), **overrides)


def test_precomputed_tis_weights_equal_fleet_logp():
    case = make_case(seed=8, with_fleet=True, params=ObjectiveParams(tis_cap=1.2))
    loss_fleet, _ = call(case, chunk_size=5)
    from megatron_offgrpo.algo import loss_parts

    weights, _ = loss_parts.truncated_is_weights(case.behavior_logp, case.kwargs["fleet_logp"], case.loss_mask, 1.2)
    loss_weights, metrics = call(case, fleet_logp=None, tis_weights=weights, chunk_size=5)
    torch.testing.assert_close(loss_weights, loss_fleet)
    assert "tis_raw_mean" not in metrics  # statistics need the fleet log-probs


def test_impl_resolution_and_default_chunk():
    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("torch", torch.device("cpu")) == "torch"
    qwen = torch.empty(151_936, 1, dtype=torch.float32)
    assert default_chunk_size(qwen, "torch") == DEFAULT_CHUNK_BYTES // (151_936 * 4) == 441
    # bf16 weights on the torch path: bf16 logits buffer + fp32 softmax buffer
    assert default_chunk_size(qwen.bfloat16(), "torch") == DEFAULT_CHUNK_BYTES // (151_936 * 6)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter makes triton run on CPU")
def test_triton_on_cpu_without_interpreter_says_how_to_fix():
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1 .* or use impl='torch'"):
        call(make_case(), impl="triton")


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_vocab_parallel_logprobs_matches_log_softmax(chunk_size):
    case = make_case(seed=9)
    targets = case.targets.clamp_min(0)
    logp, entropy = vocab_parallel_logprobs(case.hidden, case.weight, targets, temperature=0.8, compute_entropy=True,
                                            chunk_size=chunk_size)
    full = torch.log_softmax(case.hidden @ case.weight.t() / 0.8, -1)
    torch.testing.assert_close(logp, full.gather(1, targets[:, None]).squeeze(1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, torch.special.entr(full.exp()).sum(-1), rtol=1e-6, atol=1e-6)
    assert vocab_parallel_logprobs(case.hidden, case.weight, targets)[1] is None
