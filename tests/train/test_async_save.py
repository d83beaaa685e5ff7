"""``train.async_save``: checkpoints written in the background hold the state of the step they were started at (the
next step changes the weights while the writer runs), become visible only when complete, survive a ``kill -9`` of
the trainer during a write (the previous one stays the newest, ``--resume`` from it is exact, the writer dies with
the trainer), and work with the distributed optimizer, PP and LoRA (tests/workers/async_save_worker.py for the
layouts). Elsewhere: a SIGTERM during a background write (tests/train/test_signals.py), TP2 with async partial
rollouts (tests/train/test_delta_layouts.py), one process (tests/runtime/test_background_save.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_offgrpo.runlog import checkpoints
from tests.helpers import REPO, run_torchrun, save_hf_model, tiny_hf_config
from tests.train.conftest import kill_tree, metrics, train_cmd, train_env, train_proc

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORKER = REPO / "tests" / "workers" / "async_save_worker.py"
DELAY = "OFFGRPO_TEST_SAVE_DELAY_S"  # the forked writer sleeps this long before it writes (runtime.BackgroundSave)
RUN = ["train.async_save=true", "train.steps=4", "train.save_every=2", "rollout.refresh_every=2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    return str(save_hf_model(tiny_hf_config("qwen2", tied=True, layers=2), tmp_path_factory.mktemp("async") / "m"))


@pytest.mark.parametrize("nproc,layout", [
    (2, ["optim.distributed_optimizer=true"]),
    (2, ["parallel.pp=2", "lora.rank=4", "lora.alpha=8", "lora.sync=merged"])], ids=["dp2-distopt", "pp2-lora"])
def test_a_background_checkpoint_holds_the_step_it_was_started_at(hf_dir, tmp_path, nproc, layout):
    proc = run_torchrun(WORKER, nproc, [hf_dir, str(tmp_path / "run"), *layout])
    assert proc.stdout.count("EXACT") == nproc, proc.stdout[-3000:]


def _writers(pid: int) -> list[int]:
    """The background writers among ``pid``'s children: each leads a process group of its own, which it makes once
    it is set to die with the trainer."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and int(fields[2]) == int(stat.parent.name):
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_until_writing(out: Path, step: int, *overrides: str, delay: str = "4") -> tuple[subprocess.Popen, list]:
    """Start the run (its output into ``out``.log) and return once step ``step``'s checkpoint is being written in
    the background (its writer, a child of the trainer, asleep ``delay`` s before writing); returns the run and the
    writers."""
    with open(f"{out}.log", "w") as log:
        proc = subprocess.Popen(train_cmd(1, out, *RUN, *overrides), cwd=REPO, env=train_env() | {DELAY: delay},
                                stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    tmp, deadline = out / "checkpoints" / f"step_{step:08d}.tmp", time.time() + 300
    while not (tmp.is_dir() and (writers := _writers(proc.pid))):
        if proc.poll() is not None or time.time() > deadline:
            kill_tree(proc.pid)
            raise AssertionError(f"the run ended before writing step {step}: {Path(f'{out}.log').read_text()[-3000:]}")
        time.sleep(0.02)
    return proc, writers


def test_a_kill_during_a_background_write_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path):
    out = tmp_path / "run"
    proc, writers = _start_until_writing(out, 4)
    os.kill(proc.pid, signal.SIGKILL)  # the trainer alone: its writer must not outlive it
    proc.wait()
    deadline = time.time() + 10
    while any(_alive(w) for w in writers) and time.time() < deadline:
        time.sleep(0.05)
    left = [w for w in writers if _alive(w)]
    for pid in left:  # orphans now: not below the trainer any more
        os.kill(pid, signal.SIGKILL)
    assert not left, "the background writer outlived the trainer"
    assert checkpoints.latest_checkpoint(out) == out / "checkpoints" / "step_00000002"  # step 4's never published
    before = {r["step"]: r for r in metrics(out)}
    assert set(before) == {0, 1, 2, 3}, sorted(before)  # 2 and 3: the steps the resume does again
    resumed = train_proc(1, out, *RUN, "train.resume=true")
    assert f"resumed from {out / 'checkpoints' / 'step_00000002'}" in resumed.stderr
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(4))
    for step in (2, 3):  # exact: the killed run's own records of the steps after its newest checkpoint
        assert (records[step]["loss"], records[step]["reward_mean"]) == (before[step]["loss"],
                                                                           before[step]["reward_mean"]), step
    assert (out / "checkpoints" / "step_00000004" / checkpoints.STATE).exists()
    assert not list((out / "checkpoints").glob("*.tmp"))
