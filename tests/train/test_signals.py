"""SIGTERM (preemption) and SIGINT (Ctrl-C) stop a real run at the next step boundary with a checkpoint of that step,
one line and exit 143 / 130, and ``--resume`` continues to the uninterrupted run's metrics."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_offgrpo.train._stop import RunStopped, StopRequest
from tests.helpers import REPO
from tests.train.conftest import metrics, train_cmd, train_env

pytestmark = [pytest.mark.slow]

# v=1: every step boundary is one a resume reproduces exactly (the engine serves the step's own weights)
RUN = ["rollout.refresh_every=1", "train.save_every=0"]
STEPS = 6  # the one-process run: stopped twice (once by each signal), each within two steps of its start
BACKGROUND = ("train.async_save=true", "train.save_every=1")
DELAY = "OFFGRPO_TEST_SAVE_DELAY_S"  # runtime.BackgroundSave's writer sleeps this long before it writes


def _cmd(out, *overrides: str) -> list[str]:
    """``offgrpo train`` in one process (no torchrun: the exit code and the signal are the command's own)."""
    return train_cmd(1, out, *RUN, f"train.steps={STEPS}", *overrides)


def _restore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a pytest in a background job passes SIGINT down ignored


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    proc = subprocess.run(_cmd(out), cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = metrics(out)
    shutil.rmtree(out)
    return records


def _stopped_by(sig: signal.Signals, code: int, out: Path, *overrides: str) -> int:
    """Start the run (or its resume), send ``sig`` once it logged a step of its own, and check how it stops: exit
    ``code``, one line naming the checkpoint of the step it stopped at, no export; returns that step."""
    before = len(metrics(out)) if (out / "metrics.jsonl").exists() else 0
    background = "train.async_save=true" in overrides
    proc = subprocess.Popen(_cmd(out, *overrides), cwd=REPO, env=train_env() | ({DELAY: "2"} if background else {}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_restore_sigint,
                            start_new_session=background)
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") > before):
        assert proc.poll() is None and time.time() < deadline, "the run ended before it logged a step"
        time.sleep(0.02)
    if background:  # the writer of the step just logged is asleep: the signal comes while it is in flight
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)  # during the next step: it stops at the boundary after it at the latest
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == code, err[-4000:]
    assert "Traceback" not in err, err[-4000:]
    steps = len(metrics(out))
    assert before < steps <= before + 2, (before, steps)
    ckpt = out / "checkpoints" / f"step_{steps:08d}"
    line = err.strip().splitlines()[-1]
    assert line == (f"stopped by {sig.name} at step {steps}: checkpoint written to {ckpt}; resume with --resume"), err
    assert (ckpt / "trainer_state.json").exists() and not list((out / "checkpoints").glob("*.tmp"))
    # its copy of the log: the records since the previous checkpoint, as metrics.jsonl has them (fsynced before it)
    tail = json.loads((ckpt / "log_tail.json").read_text())["metrics"]
    assert tail and tail[-1]["step"] == steps - 1 and all(r in metrics(out) for r in tail)
    assert not (out / "hf").exists()  # the trained policy's export is the finished run's, never a stopped one's
    if "train.resume=true" in overrides:
        assert "resumed from" in err
    return steps


def test_a_signal_checkpoints_the_step_it_stops_at_and_resume_continues_exactly(tmp_path, uninterrupted):
    """SIGTERM stops the run, SIGINT its resume, and a second resume finishes it: the uninterrupted run's metrics,
    step for step. (One run for both signals: the second stop is also a stopped resume's.) The stopped runs write
    their checkpoints in the background (``train.async_save``, one every step, each writer asleep 2 s first), so the
    signal, sent to the whole process group as a scheduler does, finds a write in flight: the writer ignores it, the
    trainer finishes that write, then writes and publishes the checkpoint of the step it stops at."""
    out = tmp_path / "run"
    first = _stopped_by(signal.SIGTERM, 143, out, *BACKGROUND)
    _stopped_by(signal.SIGINT, 130, out, *BACKGROUND, "train.resume=true")
    resumed = subprocess.run(_cmd(out, "train.resume=true"), cwd=REPO, env=train_env(), capture_output=True,
                             text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stderr and first >= 1
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(STEPS))
    for got, want in zip(records, uninterrupted):
        assert (got["loss"], got["reward_mean"]) == (want["loss"], want["reward_mean"]), f"step {got['step']}"


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["sigterm", "sigint"])
def test_the_stop_line_and_exit_code(sig, code):
    stopped = RunStopped(sig, 3, "runs/x/checkpoints/step_00000003")
    assert stopped.exit_code == code
    assert str(stopped) == (f"stopped by {sig.name} at step 3: checkpoint written to runs/x/checkpoints/step_00000003; "
                            "resume with --resume")
    assert str(RunStopped(sig, 0, None)) == (f"stopped by {sig.name} at step 0: nothing trained yet, no checkpoint "
                                             "written")


def test_a_signal_only_sets_the_flag_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.agreed("cpu") == 0
        signal.raise_signal(signal.SIGTERM)  # the process goes on: the step in flight finishes
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
        assert stop.agreed("cpu") == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_ctrl_c_stops_at_once_with_one_line():
    """The first SIGINT asks for a checkpoint; a second one does not wait for it: exit 130 at once, one line."""
    script = ("import signal, time\n"
              "from megatron_offgrpo.train._stop import StopRequest\n"
              "with StopRequest() as stop:\n"
              "    stop.step = 5\n"
              "    signal.raise_signal(signal.SIGINT)\n"
              "    signal.raise_signal(signal.SIGINT)\n"
              "    time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=train_env(), capture_output=True, text=True,
                          timeout=60, preexec_fn=_restore_sigint)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "SIGINT: stopping after step 5 with a checkpoint (Ctrl-C again to stop at once)",
        "error: stopped at once by a second SIGINT during step 5: no checkpoint of it; --resume continues from the "
        "last complete one"]


@pytest.mark.multiproc
def test_under_torchrun_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM to rank 1 only: rank 0 (never signalled) stops after the same step, the checkpoint is whole, and a
    2-rank --resume continues from it to the end."""
    from tests.train.conftest import train_cmd

    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(2, out, *RUN, "train.steps=4"), cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first step was logged"
        time.sleep(0.02)
    [rank1] = [pid for pid in _workers(proc.pid) if "\0RANK=1\0" in _environ(pid)]
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    steps = len(metrics(out))
    ckpt = out / "checkpoints" / f"step_{steps:08d}"
    line = f"stopped by SIGTERM at step {steps}: checkpoint written to {ckpt}; resume with --resume"
    assert err.count(line) == 1 and "exitcode  : 143" in err, err[-4000:]  # once per job; both ranks exit 143
    assert (ckpt / "trainer_state.json").exists() and not list((out / "checkpoints").glob("*.tmp"))
    from tests.train.conftest import run_train

    records = run_train(2, out, *RUN, "train.steps=4", "train.resume=true")
    assert [r["step"] for r in records] == list(range(4))


def _workers(torchrun_pid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == torchrun_pid:
                pids.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def _environ(pid: int) -> str:
    return "\0" + Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def test_a_signal_stops_a_warm_up_without_a_valid_looking_model(tmp_path):
    """``offgrpo sft`` has no checkpoints: it stops at the step boundary, one line, and writes no ``hf/`` (half a
    warm-up would pass for a finished one); its records up to the stop are kept."""
    out = tmp_path / "sft"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_offgrpo.cli", "sft", "--config",
                             str(REPO / "configs" / "tiny-cpu-sft.yaml"), f"train.out_dir={out}", "train.steps=200"],
                            cwd=REPO, env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_restore_sigint)
    deadline = time.time() + 600
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().count("\n") >= 1):
        assert proc.poll() is None and time.time() < deadline, "the warm-up ended before its first step was logged"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    steps = len(metrics(out))
    assert proc.returncode == 143 and "Traceback" not in err, err[-4000:]
    assert err.strip().splitlines()[-1] == (f"stopped by SIGTERM at step {steps}: a warm-up has no checkpoints, "
                                            f"{out}/hf not written: run it again")
    assert 1 <= steps < 200 and not (out / "hf").exists()
