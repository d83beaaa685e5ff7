"""The run directory: a new run never writes into an earlier one, a resume continues the log and the schedule it
says it continues, and what a killed run left half-written is swept."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.train._checkpoint import changed_keys, resume_schedule, sweep_partial_checkpoints
from megatron_offgrpo.train._metrics import MetricsLog
from megatron_offgrpo.train._run_dir import LOCK_FILE, claim_run_dir
from tests.helpers import REPO

RECIPE = REPO / "configs" / "tiny-cpu.yaml"


def _earlier_run(run_dir, steps=3):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "wall_s": 1.0 + s}) + "\n" for s in range(steps)))


def test_a_new_run_refuses_an_earlier_runs_directory(tmp_path, capsys):
    _earlier_run(tmp_path / "run")
    with pytest.raises(SystemExit) as exit_:
        claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path / 'run'}"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1
    assert f"train.out_dir={tmp_path / 'run'} holds an earlier run (metrics.jsonl)" in err
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # untouched
    claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path / 'run'}", "train.resume=true"]))  # resuming: fine
    claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path / 'new'}"]))  # a new directory: fine


def test_overwrite_moves_the_earlier_run_aside(tmp_path):
    _earlier_run(tmp_path / "run")
    lock = claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path / 'run'}", "train.overwrite=true"]))
    [aside] = tmp_path.glob("run.replaced-*")
    assert len((aside / "metrics.jsonl").read_text().splitlines()) == 3
    assert [p.name for p in (tmp_path / "run").iterdir()] == [LOCK_FILE] and lock.fd is not None  # new, locked


def test_resume_drops_the_steps_it_redoes_and_continues_the_clock(tmp_path):
    _earlier_run(tmp_path, steps=5)
    log = MetricsLog(tmp_path, total_steps=6)
    log.resume_at(3)  # the checkpoint was taken after step 3: steps 3 and 4 run again
    log.log(3, {"reward_mean": 0.5})
    log.close()
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[3]["wall_s"] >= records[2]["wall_s"] == 3.0  # wall-clock continues, never restarts at 0


def test_interrupted_checkpoint_saves_are_swept(tmp_path):
    (tmp_path / "checkpoints" / "step_00000004.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000002").mkdir()
    assert [p.name for p in sweep_partial_checkpoints(tmp_path)] == ["step_00000004.tmp"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000002"]


def _scheduler(steps: int, lr: float = 1e-3):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=0.0, lr_warmup_steps=0,
                                   lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                   wd_incr_steps=steps, wd_incr_style="constant")


def test_a_resume_with_more_steps_re_plans_the_schedule(caplog):
    finished = _scheduler(12)
    finished.step(increment=12)  # a finished 12-step run: the cosine reached 0
    assert finished.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    extended = _scheduler(14)
    with caplog.at_level("WARNING"):
        resume_schedule(extended, finished.state_dict())
    assert extended.num_steps == 12 and extended.optimizer.param_groups[0]["lr"] > 1e-5  # not megatron's silent 0
    assert "lr_decay_steps 12 -> 14" in caplog.text and "re-planned from step 12" in caplog.text
    same = _scheduler(12)
    resume_schedule(same, _scheduler(12).state_dict())  # an unchanged schedule loads as saved, silently
    assert same.num_steps == 0


def test_a_resume_names_the_keys_that_changed():
    saved = load_config(RECIPE).to_dict()
    now = load_config(RECIPE, ["algo.eps_high=0.28", "train.steps=80", "train.resume=true"]).to_dict()
    assert changed_keys(saved, now) == ["algo.eps_high 0.2 -> 0.28"]  # steps and resume are how a resume is asked
    assert changed_keys(None, now) == []
