"""The training step never makes the host wait for the device between its first forward and the end of its
backward, reads its metrics once, and megatron's optimizer step reads only the grad norm (issue 34;
``tests/workers/step_syncs_worker.py`` counts, ``train._step`` says why)."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, worker_report

WORKER = REPO / "tests" / "workers" / "step_syncs_worker.py"


def _syncs(tmp_path, device: str) -> dict[str, float]:
    return worker_report(WORKER, tmp_path, "SYNCS", device, cpu=device == "cpu", timeout=600)


def test_cpu_step_counts_no_synchronising_call_in_its_forward_and_backward(tmp_path):
    syncs = _syncs(tmp_path, "cpu")
    assert syncs["backward"] == 0, syncs
    assert syncs["read"] == 1, syncs  # the loss and every metric in one transfer
    # megatron's clip reads the total norm once (clip_grads.get_grad_norm_fp32's .item()); its local l2 norm,
    # put back, reads every parameter's norm: what runtime._local_fallbacks removes
    assert syncs["optimizer"] == 1, syncs
    assert syncs["local_l2"] > syncs["optimizer"] + 10, syncs


@pytest.mark.gpu
def test_cuda_step_passes_sync_debug_mode_error(tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    syncs = _syncs(tmp_path, "cuda")  # the worker's backward runs under set_sync_debug_mode("error")
    assert syncs["backward"] == 0 and syncs["read"] == 1 and syncs["optimizer"] <= 2, syncs
