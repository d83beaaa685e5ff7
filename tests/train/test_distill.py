"""On-policy distillation runs: the teacher's per-token reverse KL as the advantage, alone or beside the reward.

At step 0 of an on-policy run (v = 1) the policy is the behavior policy (ratio 1 up to the engine's rounding), so with
token-mean aggregation the pure-distillation loss is the mean over trained tokens of log pi_student - log pi_teacher:
the ``teacher_kl`` metric itself. At TP2 and PP2 a step (the teacher scored at that layout) equals a float64 HF
reference, loss and gradient (``tests/workers/distill_grad_worker.py``).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import REPO, run_torchrun, save_hf_model
from tests.train.conftest import run_train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    config = json.loads(open("megatron_offgrpo/assets/tiny-qwen2/config.json").read())
    # the teacher's larger init makes it peaked where the student is near uniform: a reverse KL well above 0
    teacher = save_hf_model(dict(config, initializer_range=0.2), root / "teacher", seed=5)
    return save_hf_model(config, root / "student", seed=3), teacher


def test_pure_distillation_loss_is_the_reverse_kl(tmp_path, models):
    student, teacher = models
    records = run_train(1, tmp_path, f"model.hf_path={student}", "model.init=hf", f"distill.teacher_path={teacher}",
                        "train.steps=2", "rollout.refresh_every=1")
    first = records[0]
    assert first["teacher_kl"] > 0.01 and first["teacher_s"] > 0  # two different random models
    assert math.isclose(first["loss"], first["teacher_kl"], rel_tol=1e-4), (first["loss"], first["teacher_kl"])
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in records)  # every sample trains (no reward signal)


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_distillation_loss_and_gradient_equal_the_fp64_reference(tmp_path, models, layout):
    """Distillation beside the reward, discounted, off-policy (tests/workers/distill_grad_worker.py)."""
    student, teacher = models
    proc = run_torchrun(REPO / "tests" / "workers" / "distill_grad_worker.py", 2,
                        [str(tmp_path), str(student), str(teacher), layout])
    assert "MATCH" in proc.stdout, proc.stdout[-2000:]
