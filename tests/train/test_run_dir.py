"""The run directory: a new run never writes into an earlier one, a resume continues the log and the schedule it
says it continues, and what a killed run left half-written is swept."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.runlog._checkpoints import changed_keys, sweep_partial
from megatron_offgrpo.train._checkpoint import resume_schedule
from megatron_offgrpo.runlog._metrics import MetricsLog
from megatron_offgrpo.runlog._run_dir import LOCK_FILE, claim_run_dir
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
    assert [p.name for p in sweep_partial(tmp_path)] == ["step_00000004.tmp"]
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
    now = load_config(RECIPE, ["algo.eps_high=0.28", "train.steps=80", "train.resume=true",
                               "train.async_save=true"]).to_dict()
    assert changed_keys(saved, now) == ["algo.eps_high 0.2 -> 0.28"]  # steps and resume are how a resume is asked
    assert changed_keys(None, now) == []


# --- offgrpo sft and offgrpo train share the run directory's rules (issue 35, rows 1, 2, 4, 6) ---

SFT_RECIPE = str(REPO / "configs" / "tiny-cpu-sft.yaml")  # its model is a bundled asset: loads anywhere


def _snapshot(root) -> dict[str, str]:
    """Every path under ``root`` (hidden ones too) with its content: nothing written, nothing lost."""
    return {str(p.relative_to(root)): p.read_text() if p.is_file() else "dir" for p in sorted(root.rglob("*"))}


def _refused(argv: list[str], capsys) -> str:
    """Run ``offgrpo ARGV`` in process; it must exit 2 with one line and no traceback; returns that line."""
    from megatron_offgrpo.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.mark.parametrize("command", ["train", "sft"])
@pytest.mark.parametrize("earlier", ["metrics", "checkpoint"])
def test_sft_and_train_refuse_an_earlier_runs_directory(command, earlier, tmp_path, capsys):
    run = tmp_path / "rl-run"
    if earlier == "metrics":
        _earlier_run(run)
        (run / "hf").mkdir()
        (run / "hf" / "config.json").write_text("{}")  # the RL run's trained policy: never replaced
    else:
        (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    before = _snapshot(tmp_path)
    line = _refused([command, "--config", SFT_RECIPE, f"train.out_dir={run}", "train.steps=2"], capsys)
    found = "metrics.jsonl" if earlier == "metrics" else "checkpoints/"
    assert f"error: train.out_dir={run} holds an earlier run ({found}): " in line
    assert "train.overwrite=true" in line and (("--resume" in line) == (command == "train"))
    assert _snapshot(tmp_path) == before  # not even a lock file


def test_sft_has_no_resume(tmp_path, capsys):
    line = _refused(["sft", "--config", SFT_RECIPE, f"train.out_dir={tmp_path / 'w'}", "train.resume=true"], capsys)
    assert line.startswith("error: train.resume=true: offgrpo sft has no resume") and not (tmp_path / "w").exists()


def _path_case(case: str, tmp_path, monkeypatch) -> tuple[list[str], str]:
    """(overrides, what the line must say) of a bad ``train.out_dir``, the files it needs made under tmp_path."""
    (tmp_path / "a-file").write_text("someone's file")
    if case == "empty":
        return ["train.out_dir="], "error: train.out_dir is empty: name the run directory"
    if case == "long-name":
        name = "x" * 256
        return [f"train.out_dir={tmp_path / name}"], f"train.out_dir={tmp_path / name}: the component xxx"
    if case == "file":
        return [f"train.out_dir={tmp_path / 'a-file'}"], f"train.out_dir={tmp_path / 'a-file'} is a file: "
    if case == "under-a-file":
        return [f"train.out_dir={tmp_path / 'a-file' / 'run'}"], f"lies under the file {tmp_path / 'a-file'}: "
    if case == "model-inside-overwrite":
        import shutil

        _earlier_run(tmp_path / "run")
        model = tmp_path / "run" / "model"
        shutil.copytree(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2", model)
        return [f"train.out_dir={tmp_path / 'run'}", f"model.hf_path={model}", "train.overwrite=true"], (
            f"error: train.overwrite=true: model.hf_path={model} lies inside train.out_dir={tmp_path / 'run'}")
    _earlier_run(tmp_path)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    if case == "dot-overwrite":
        _earlier_run(tmp_path / "cwd")
        return ["train.out_dir=.", "train.overwrite=true"], "train.out_dir=. with train.overwrite=true: "
    if case == "ancestor-overwrite":
        return ["train.out_dir=..", "train.overwrite=true"], "holds the working directory or the checkout"
    assert case == "checkout-overwrite", case
    return [f"train.out_dir={REPO}", "train.overwrite=true"], "holds the working directory or the checkout"


PATH_CASES = ["empty", "long-name", "file", "under-a-file", "dot-overwrite", "ancestor-overwrite",
              "checkout-overwrite", "model-inside-overwrite"]


@pytest.mark.parametrize("command", ["train", "sft"])
@pytest.mark.parametrize("case", PATH_CASES)
def test_a_bad_run_directory_is_one_line_before_anything_starts(command, case, tmp_path, monkeypatch, capsys):
    overrides, message = _path_case(case, tmp_path, monkeypatch)
    before = _snapshot(tmp_path)
    line = _refused([command, "--config", SFT_RECIPE, *overrides], capsys)
    assert message in line, line
    assert _snapshot(tmp_path) == before  # nothing moved aside, nothing created


def _hold_lock_in_subprocess(run_dir):
    """A second process holding ``run_dir``'s lock as a running ``offgrpo train`` does; returns it once it holds."""
    import subprocess
    import sys

    code = ("import sys, time; from megatron_offgrpo.config import load_config; "
            "from megatron_offgrpo.runlog._run_dir import claim_run_dir; "
            f"lock = claim_run_dir(load_config({SFT_RECIPE!r}, ['train.out_dir={run_dir}'])); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("command, extra", [("train", []), ("train", ["train.resume=true"]),
                                            ("train", ["train.overwrite=true"]), ("sft", [])])
def test_a_run_directory_in_use_is_refused_and_a_dead_holder_blocks_nothing(command, extra, tmp_path, capsys):
    run = tmp_path / "run"
    holder = _hold_lock_in_subprocess(run)
    try:
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "wall_s": 1.0}) + "\n")  # the live run's step 0
        before = _snapshot(tmp_path)
        line = _refused([command, "--config", SFT_RECIPE, f"train.out_dir={run}", *extra], capsys)
        assert line.startswith(f"error: train.out_dir={run} is locked by a run in progress (pid {holder.pid} on ")
        assert "offgrpo train since" in line and _snapshot(tmp_path) == before  # the live run is not moved aside
    finally:
        holder.kill()  # kill -9: the kernel drops its lock
        holder.wait()
    lock = claim_run_dir(load_config(RECIPE, [f"train.out_dir={run}", "train.resume=true"]))
    assert lock is not None and json.loads((run / LOCK_FILE).read_text())["pid"] == __import__("os").getpid()
    lock.release()


def test_under_torchrun_every_rank_refuses_another_jobs_lock(tmp_path, monkeypatch, capsys):
    """Rank 0 takes the lock; the other ranks check it before any process group exists: their own job's rank 0
    holding it is fine, another job's is refused on every rank (the same line)."""
    config = load_config(RECIPE, [f"train.out_dir={tmp_path / 'run'}"])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    lock = claim_run_dir(config)  # this job's rank 0
    monkeypatch.setenv("RANK", "1")
    assert claim_run_dir(config) is None  # this job's rank 1
    monkeypatch.setenv("MASTER_PORT", "29501")  # another job's rank 1
    with pytest.raises(SystemExit) as exit_:
        claim_run_dir(config)
    assert exit_.value.code == 2 and f"is locked by a run in progress (pid {__import__('os').getpid()} on " in (
        capsys.readouterr().err)
    lock.release()
    assert claim_run_dir(config) is None  # released: nothing to refuse


@pytest.mark.parametrize("tail", ['{"step": 3, "wall_s": 4.0, "rew', '{"step": 3, "wall_s": 4.0, "rew\n', "\x00\x00"])
def test_a_torn_last_record_is_cut_off_on_resume(tail, tmp_path, capsys):
    _earlier_run(tmp_path, steps=3)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(tail)
    lock = claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path}", "train.resume=true"]))
    lock.release()
    err = capsys.readouterr().err
    assert err.splitlines() == [f"WARNING: {tmp_path / 'metrics.jsonl'}:4: a torn last record (the run stopped while "
                                "writing it) was cut off; the resume starts at step 0 (no complete checkpoint) and "
                                "logs every step again"]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


def _log_with_checkpoints(run_dir, steps: int, save_every: int, keep_copy: bool = True) -> None:
    """A run's log of ``steps`` steps, checkpointed every ``save_every`` as the loop does: each checkpoint's records
    made durable first and its copy of them written beside its state (``save_checkpoint``'s two files)."""
    log = MetricsLog(run_dir, total_steps=steps)
    for step in range(steps):
        log.log(step, {"reward_mean": step / 10})
        if (step + 1) % save_every == 0:
            tail, ckpt = log.checkpoint_tail(), run_dir / "checkpoints" / f"step_{step + 1:08d}"
            ckpt.mkdir(parents=True)
            if keep_copy:  # False: a checkpoint written before checkpoints kept one
                (ckpt / "log_tail.json").write_text(json.dumps(tail))
            (ckpt / "trainer_state.json").write_text(json.dumps({"step": step + 1}))
    log.close()


@pytest.mark.parametrize("keep_copy", [True, False])
def test_a_resume_with_records_behind_its_checkpoint_restores_them_or_names_them(keep_copy, tmp_path, capsys, caplog):
    """The audit's case moved: not the last record torn behind a checkpoint one step ahead, but the last two lost
    (step 8's gone, step 7's torn) behind a checkpoint after step 8. Every step is logged exactly once after the
    resume (from the checkpoint's copy of the log), and each warning says what happens; a checkpoint without a copy
    names the steps lost instead of promising them again."""
    from megatron_offgrpo.runlog._checkpoints import latest_checkpoint, read_log_tail

    _log_with_checkpoints(tmp_path, steps=9, save_every=3, keep_copy=keep_copy)  # checkpoints after 3, 6 and 9 steps
    path = tmp_path / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:7]) + "\n" + lines[7][:15])  # steps 0-6, then step 7 torn, no step 8
    capsys.readouterr()
    lock = claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path}", "train.resume=true"]))
    fate = (": restored from step_00000009's copy of the log" if keep_copy
            else " and not in step_00000009's copy of the log: that step's record is lost")
    assert capsys.readouterr().err.splitlines() == [
        f"WARNING: {path}:8: a torn last record (the run stopped while writing it) was cut off; its step 7 is before "
        f"the resume's (step 9){fate}"]
    log = MetricsLog(tmp_path, total_steps=10)
    with caplog.at_level("WARNING", logger="megatron_offgrpo.runlog._metrics"):
        log.resume_at(9, read_log_tail(latest_checkpoint(tmp_path)))  # what train.loop._start does
    log.log(9, {"reward_mean": 0.9})
    log.close()
    lock.release()
    steps = [json.loads(x)["step"] for x in path.read_text().splitlines()]
    if keep_copy:
        assert steps == list(range(10))
        assert "step(s) 7-8 were missing (a torn or lost write): restored from the checkpoint's copy" in caplog.text
    else:
        assert steps == [0, 1, 2, 3, 4, 5, 6, 9]
        assert "step(s) 7-8 are missing and not in the checkpoint's copy of the log" in caplog.text


@pytest.mark.parametrize("bad, message", [
    ('{"step": 1, "wall_s"', "metrics.jsonl:2: not a JSON record (Expecting ':' delimiter, column 21)"),
    ("[1, 2]", "metrics.jsonl:2: a JSON list, not a record"),
])
def test_a_bad_record_before_the_last_refuses_the_resume(bad, message, tmp_path, capsys):
    _earlier_run(tmp_path, steps=3)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], bad, *lines[1:]]) + "\n")
    before = _snapshot(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        claim_run_dir(load_config(RECIPE, [f"train.out_dir={tmp_path}", "train.resume=true"]))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and f"error: {tmp_path}/{message}" in err, err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("site", ["metrics", "samples", "rewrite"])
def test_a_full_disk_names_the_file_being_written(site, tmp_path, monkeypatch):
    import errno

    from megatron_offgrpo.data import Sample
    from megatron_offgrpo.runlog import no_space_line

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "x"

    log = MetricsLog(tmp_path, total_steps=2, samples_every=1, tokenizer=Tok())
    sample = Sample("p", 0, [1], [2], [0.0], 0, "stop", reward=1.0)
    if site == "metrics":
        monkeypatch.setattr(log, "_file", type("Full", (), {"write": staticmethod(no_space)})())
        target = tmp_path / "metrics.jsonl"
    elif site == "samples":
        monkeypatch.setattr("builtins.open", lambda *a, **k: type("Full", (), {
            "__enter__": lambda self: self, "__exit__": lambda self, *e: None, "writelines": no_space})())
        target = tmp_path / "samples.jsonl"
    else:
        monkeypatch.setattr("pathlib.Path.write_text", no_space)
        target = tmp_path / "metrics.jsonl.tmp"
    with pytest.raises(OSError) as raised:
        log.resume_at(0) if site == "rewrite" else log.log(0, {"loss": 1.0}, [sample])
    assert no_space_line(raised.value, str(tmp_path)) == (
        f"error: {target}: no space left on device (errno {errno.ENOSPC}): free space there, then continue with "
        "--resume from the newest complete checkpoint")
    assert no_space_line(OSError(errno.EACCES, "Permission denied"), str(tmp_path)) is None


# --- real runs (one process, the tiny model): an interrupted export is written again, a full disk is one line ---

def _cli_train(out, *overrides: str, prelude: str = "", timeout: float = 600):
    """``offgrpo train`` on the tiny model in a fresh process; ``prelude``: Python run first (a fault injected at a
    write site)."""
    import subprocess
    import sys

    from tests.train.conftest import TINY, train_env

    code = f"{prelude}\nfrom megatron_offgrpo.cli import main\nmain()"
    return subprocess.run([sys.executable, "-c", code, "train", *TINY, f"train.out_dir={out}", *overrides], cwd=REPO,
                          env=train_env(), capture_output=True, text=True, timeout=timeout)


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow  # a real run (or engine): over a minute on the 2-core machine
def test_a_resume_writes_the_export_a_kill_interrupted(tmp_path):
    """The state a ``kill -9`` during step 1's periodic export leaves (its checkpoint complete, ``exports/step_1``
    only as the writer's temporary sibling, a torn metrics line, no final ``hf/``) is resumed: the export is written
    again, the temporaries are swept, the torn line is cut off; each said in one line."""
    import shutil

    from checkpoint_tools._io import _owner_tag

    run = tmp_path / "run"
    first = _cli_train(run, "train.steps=2", "train.save_every=1", "train.export_every=1")
    assert first.returncode == 0, first.stderr[-4000:]
    reference = (run / "exports" / "step_00000001" / "model.safetensors").read_bytes()
    shutil.rmtree(run / "checkpoints" / "step_00000002")
    shutil.rmtree(run / "hf")
    tag = f"{_dead_pid()}-{_owner_tag().split('-')[1]}-0badc0de"
    (run / "exports" / "step_00000001").rename(run / "exports" / f".step_00000001.tmp-{tag}")
    (run / f".hf.tmp-{tag}").mkdir()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "wall_s": 9.')
    resumed = _cli_train(run, "train.steps=2", "train.save_every=1", "train.export_every=1", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    err = resumed.stderr
    assert f"WARNING: {run / 'metrics.jsonl'}:3: a torn last record (the run stopped while writing it) was cut " \
        "off" in err
    assert f"removed {run / 'exports'}/.step_00000001.tmp-{tag}, left by an HF export that was interrupted" in err
    assert f"resume: {run / 'exports' / 'step_00000001'} was not written (the run stopped during it): writing it now" \
        in err
    assert (run / "exports" / "step_00000001" / "model.safetensors").read_bytes() == reference  # the same weights
    assert (run / "hf" / "config.json").is_file()
    assert not list(run.glob(".hf.tmp-*")) and not list((run / "exports").glob(".*"))
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


@pytest.mark.slow  # a real run (or engine): over a minute on the 2-core machine
def test_a_full_disk_during_a_checkpoint_is_one_line_and_leaves_only_its_tmp(tmp_path):
    """ENOSPC injected where rank 0 writes the checkpoint's model card (a real write site of the save): exit 1, one
    line naming the checkpoint being written and "no space left"; the step stays ``step_N.tmp``, never complete."""
    run = tmp_path / "run"
    prelude = ("import errno, megatron_offgrpo.train._checkpoint as c\n"
               "def full(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
               "c.dist_ckpt.write_model_card = full")
    proc = _cli_train(run, "train.steps=1", "train.save_every=1", prelude=prelude)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert last == (f"error: {run / 'checkpoints' / 'step_00000001.tmp'}: no space left on device (errno 28): free "
                    "space there, then continue with --resume from the newest complete checkpoint")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001.tmp"] and not (run / "hf").exists()


@pytest.mark.multiproc
def test_under_torchrun_a_locked_run_dir_is_refused_on_every_rank(tmp_path):
    """Two ranks started by torchrun into a directory another run holds: each prints the one line and exits 2 before
    any process group exists (seconds: nothing is imported past the preflight)."""
    import subprocess

    from tests.train.conftest import train_cmd, train_env

    run = tmp_path / "run"
    holder = _hold_lock_in_subprocess(run)
    try:
        proc = subprocess.run(train_cmd(2, run, "train.resume=true"), cwd=REPO, env=train_env(), capture_output=True,
                              text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    line = f"error: train.out_dir={run} is locked by a run in progress (pid {holder.pid} on "
    assert proc.returncode != 0 and proc.stderr.count(line) == 2, proc.stderr[-4000:]
    assert "megatron_offgrpo/" not in proc.stderr  # no traceback of ours (torchrun prints its own summary)
    assert [p.name for p in run.iterdir()] == [LOCK_FILE]


def test_the_trainer_state_is_typed_and_a_bad_one_is_named(tmp_path):
    """``trainer_state.json`` round-trips as ``TrainerState`` (a newer writer's extra key ignored, an older
    checkpoint's missing version read as 0), and a state without its step or scheduler is named with its file."""
    from megatron_offgrpo.train._checkpoint import TrainerState

    state = TrainerState(step=8, version=8, scheduler={"num_steps": 8, "max_lr": 1e-3}, config={"train": {"steps": 9}})
    (tmp_path / "trainer_state.json").write_text(state.to_json())
    assert TrainerState.read(tmp_path) == state and "stream" not in json.loads(state.to_json())
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 4, "scheduler": {}, "stream": {"epoch": 1},
                                                             "from_the_future": 1}))
    assert TrainerState.read(tmp_path) == TrainerState(4, 0, {}, None, {"epoch": 1})
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": "x", "scheduler": {}}))
    with pytest.raises(ValueError, match="trainer_state.json: not a trainer state .*remove this step_N"):
        TrainerState.read(tmp_path)
