"""The CPU container image, built and run for real with podman (marker ``container``; opt-in: ``-m container``).

``launch/build_image.sh`` makes the base (once) and the image (podman's layer cache: seconds when nothing changed,
~4 min when the code or its dependencies did), then one container warms up the tiny model (2 steps), a second trains
on it with the in-process vLLM CPU engine until ``podman kill --signal TERM`` stops it (the trainer checkpoints and
the container exits 143), and a third, new container resumes the run from the mounted run directory and finishes it
(its run log names the checkpoint it continues from). Measured on 2 cores (2026-11-29): 56 s with the image current
(the build is a cache hit), 3.5-4.2 min when the image's environment is rebuilt (any change to the code, the README or
the dependencies comes before `make setup` in Dockerfile.cpu).

Skipped, with a one-line reason, where podman is missing or cannot run a container under the project's
``launch/containers.conf`` (a real ``podman run --rm BASE true``: CI installs no podman, and the probe takes well
under 2 s there), and unless selected with ``-m container``: where podman works, a build and three containers would
take minutes of the suite's 30-minute budget.

    PYTHONPATH=$PWD .venv/bin/python -m pytest -q -m container tests/launch/test_container_image.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]  # not tests.helpers: that imports torch, and the skip must be quick

pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(2400)]

IMAGE = os.environ.get("IMAGE", "megatron-offgrpo:0.1.0-cpu")
BASE = os.environ.get("BASE", "localhost/offgrpo-debian:bookworm")
ENV = dict(os.environ, CONTAINERS_CONF=str(REPO / "launch" / "containers.conf"))
WORKDIR = "/workspace/megatron-offgrpo"
STEPS = 6


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    return proc


def podman_problem() -> str | None:
    """Why no container can run here (None: one ran): podman missing, no base image, or the run failing."""
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install -y podman buildah debootstrap runc)"
    try:
        if podman("image", "exists", BASE, timeout=30, check=False).returncode != 0:
            return f"no base image {BASE}: launch/build_image.sh --base-only makes it (needs debootstrap)"
        proc = podman("run", "--rm", BASE, "true", timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"podman cannot run a container: {exc}"
    if proc.returncode != 0:
        return f"podman cannot run a container: {proc.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def image(request) -> str:
    if "container" not in (request.config.option.markexpr or ""):
        pytest.skip("builds and runs the container image (minutes): select it with -m container")
    problem = podman_problem()
    if problem:
        pytest.skip(problem)
    build = subprocess.run(["bash", str(REPO / "launch" / "build_image.sh")], cwd=REPO, env=ENV, capture_output=True,
                           text=True, timeout=1800)
    assert build.returncode == 0, f"launch/build_image.sh failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"
    return IMAGE


def run_args(name: str, runs: Path, *command: str, detach: bool = False) -> list[str]:
    # --init: PID 1 is podman's init, which forwards SIGTERM to the trainer and reaps what it leaves
    return ["run", *(["-d"] if detach else []), "--init", "--name", name, "-v", f"{runs}:{WORKDIR}/runs", IMAGE,
            *command]


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_trainer_in_the_image_stops_on_sigterm_and_resumes_in_a_new_container(image, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    tag = f"offgrpo-test-{os.getpid()}"
    names = [f"{tag}-{role}" for role in ("sft", "train", "resume")]
    try:
        assert "offgrpo train" in podman("run", "--rm", IMAGE, "offgrpo", "--help").stdout
        podman(*run_args(names[0], runs, "offgrpo", "sft", "--config", "configs/tiny-cpu-sft.yaml", "train.steps=2"))
        assert (runs / "tiny-cpu-sft" / "hf" / "config.json").exists()
        train = ("offgrpo", "train", "--config", "configs/tiny-cpu.yaml", f"train.steps={STEPS}", "train.save_every=2",
                 "train.eval_every=0", "rollout.refresh_every=2", "rollout.engine=vllm")  # no fallback
        podman(*run_args(names[1], runs, *train, detach=True))
        run = runs / "tiny-cpu"
        deadline = time.time() + 900
        while len(metrics(run)) < 2:  # two steps done, a refresh among them; SIGTERM then lands in a later one
            state = podman("inspect", "-f", "{{.State.Status}}", names[1]).stdout.strip()
            assert state == "running", f"the trainer's container is {state}:\n{podman('logs', names[1]).stderr}"
            assert time.time() < deadline, "no step 2 within 15 minutes"
            time.sleep(1)
        podman("kill", "--signal", "TERM", names[1])
        code = podman("wait", names[1], timeout=600).stdout.strip()
        logs = podman("logs", names[1])
        assert code == "143", f"SIGTERM: the container exited {code}, not 143:\n{logs.stderr[-4000:]}"
        assert "stopped by SIGTERM" in logs.stderr and "resume with --resume" in logs.stderr, logs.stderr[-4000:]
        stopped = len(metrics(run))
        assert stopped < STEPS
        podman(*run_args(names[2], runs, *train, "--resume"), timeout=1200)
        resumed = podman("logs", names[2]).stderr
        assert "resumed from" in resumed, resumed[-4000:]
        assert [r["step"] for r in metrics(run)] == list(range(STEPS))  # every step once, none lost or repeated
        assert (run / "checkpoints").exists()
    finally:
        for name in names:
            podman("rm", "-f", "-t", "0", name, check=False)
