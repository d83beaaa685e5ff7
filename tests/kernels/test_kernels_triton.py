"""The Triton path equals algo's reference loss: on CPU under the interpreter (small fp32 shapes, in a subprocess
so TRITON_INTERPRET never leaks into other tests), and compiled on CUDA (marked gpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_offgrpo.algo import ObjectiveParams, reference_loss
from megatron_offgrpo.kernels import fused_linear_grpo_loss
from tests.helpers import REPO
from tests.kernels._cases import make_case, rel_err
from tests.kernels.test_kernels_masked_micro_batch import OBJECTIVES

HAVE_TRITON = importlib.util.find_spec("triton") is not None
TOL = 1e-6
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")


@pytest.fixture(scope="module")
def interpreted() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels._triton_interp"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("name", ["grpo_chunk5", "full_chunk7", "multiblock_v50", "all_masked"])
def test_interpreted_triton_matches_reference(interpreted, name):
    result = interpreted[name]
    assert result["loss"] <= TOL and result["grad_hidden"] <= TOL and result["grad_weight"] <= TOL, result
    assert result["metrics"], result


@needs_triton
def test_interpreted_triton_logprobs_match_torch(interpreted):
    assert interpreted["logprobs"]["logp"] <= TOL and interpreted["logprobs"]["entropy"] <= TOL


@needs_triton
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_interpreted_triton_all_masked_micro_batches(interpreted, name):
    # as test_kernels_masked_micro_batch.py on the torch path: loss 0 and zero grads alone, the reference beside another
    assert interpreted["masked_objectives"][name] == {"loss": 0.0, "grad_max": 0.0, "metrics": True}
    mixed = interpreted["mixed"][name]
    assert mixed["loss"] <= TOL and mixed["grad_hidden"] <= TOL and mixed["grad_weight"] <= TOL, mixed
    assert mixed["empty_grad_max"] == 0.0


@needs_triton
def test_interpreted_triton_decides_the_gspo_clip_once_per_sequence(interpreted):
    results = interpreted["gspo_edges"]
    assert {r["side"] for r in results} == {"seq_eps_low", "seq_eps_high"}, results
    for result in results:
        assert result["edge_kept"] and result["split_sequences"] == [], result
        assert result["clipped_tokens"] == result["zero_grad_tokens"], result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled Triton kernels)")
@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_compiled_matches_reference_on_cuda(impl, dtype, tol):
    # fp32: cuBLAS sums in another order than the CPU (TF32 is off by default); bf16: as the CPU bf16 test
    case = make_case(seed=2, groups=8, seq_len=64, hidden_size=256, vocab=5000, entropy=True, temperature=0.9,
                     params=ObjectiveParams(kl_beta=0.05, aggregation="seq_mean_token_mean"))
    cuda = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs.items()}
    per_token = [t.cuda() for t in (case.targets, case.behavior_logp, case.advantages, case.loss_mask)]
    results = {}
    for name in (impl, "reference"):
        hidden, weight = (t.detach().cuda().requires_grad_(True) for t in case.tensors(dtype))
        if name == "reference":
            loss, _ = reference_loss(hidden @ weight.t(), *per_token, case.params, **cuda)
        else:
            loss, _ = fused_linear_grpo_loss(hidden, weight, *per_token, case.params, chunk_size=100, impl=impl,
                                             **cuda)
        loss.backward()
        results[name] = (loss.detach(), hidden.grad, weight.grad)
    for ours, ref in zip(results[impl], results["reference"]):
        assert rel_err(ours.cpu(), ref.cpu()) <= tol
