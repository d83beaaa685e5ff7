"""``runtime.BackgroundSave``: megatron's asynchronous checkpoint write in a forked process, its results handed back
through a file of the checkpoint (``runtime._save_queue``), from a copy (the trainer's own tensors are not mapped by
the writer: its next step copies no page), and every way it can fail said on every rank: a writer
that died, one past its bound (killed with its own writers), never a commit of an incomplete checkpoint."""

from __future__ import annotations

import pickle
import queue
import subprocess
import sys
import textwrap

import pytest

from megatron_offgrpo.runtime._save_queue import FileResults
from tests.helpers import REPO


def test_the_file_results_queue_has_one_slot_and_is_empty_once_read(tmp_path):
    results = FileResults(tmp_path / ".write_results.1.pkl")
    with pytest.raises(queue.Empty):
        results.get_nowait()  # a writer that died before putting anything: megatron's "should not be empty"
    results.put({0: ["result"]})
    assert not list(tmp_path.glob("*.part")) and pickle.loads(results.path.read_bytes()) == {0: ["result"]}
    assert results.get_nowait() == {0: ["result"]}
    with pytest.raises(queue.Empty):
        results.get_nowait()  # read once: never handed to a later save


SCRIPT = """
    import os, time, types
    from pathlib import Path
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron_offgrpo.runtime import BackgroundSave, SaveFailed, init_parallel

    init_parallel(1, 1)
    root = Path({root!r})
    weight = torch.arange(float(1 << 20)).reshape(1024, 1024)  # 4 MiB: pages of its own
    # a trainer's model and megatron-style optimizer (its torch optimizer as .optimizer): what its step writes
    model = torch.nn.Linear(1024, 1024, bias=False)
    model.weight.main_grad = torch.zeros(1 << 20)
    optimizer = types.SimpleNamespace(optimizer=torch.optim.Adam(model.parameters()))
    committed = []

    def mapped(pid, tensor):  # whether process pid maps the middle byte of tensor
        at = tensor.data_ptr() + tensor.nbytes // 2
        for line in open(f"/proc/{{pid}}/maps"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= at < end:
                return True
        return False

    def save(name, background, **env):
        os.environ.update(OFFGRPO_TEST_SAVE_DELAY_S=env.get("delay", "0"))
        out = root / name
        out.mkdir()
        request = background.prepare({{"w": ShardedTensor.from_rank_offsets("w", weight)}}, out)
        background.start(request, name, lambda: committed.append(name), model, optimizer)
        return out

    background = BackgroundSave("cpu")
    out = save("good", background, delay="1")
    writer = background._writer()
    for kept in (weight, model.weight, model.weight.main_grad):
        assert not mapped(writer.pid, kept), "the trainer's tensors are kept out of the writer's fork"
    assert mapped(os.getpid(), weight)
    weight.add_(100.0)  # the next step, at once: the writer (asleep) must still write the values at the save
    background.poll()  # still writing: returns at once
    assert background.what == "good" and committed == []
    background.finish("the test")
    empty = {{"w": ShardedTensor.from_rank_offsets("w", torch.zeros(1024, 1024))}}
    assert committed == ["good"] and torch.equal(dist_checkpointing.load(empty, str(out))["w"], weight - 100.0)
    assert not list(out.glob(".write_results*")), "the results file is read and removed"

    save("killed", background, delay="30")
    background._writer().kill()  # the writer dies (an OOM kill): the save fails, never commits
    try:
        background.finish("the test")
        raise AssertionError("no error")
    except SaveFailed as exc:
        print("KILLED", exc)

    import shutil
    gone = save("gone", background, delay="1")
    shutil.rmtree(gone)  # its directory removed under the writer: the write fails, said with the disk's free space
    try:
        background.finish("the test")
        raise AssertionError("no error")
    except SaveFailed as exc:
        print("GONE", exc)

    slow = BackgroundSave("cpu", timeout_s=1.0)
    save("slow", slow, delay="30")
    writer = slow._writer()
    start = time.monotonic()
    try:
        slow.finish("the test")
        raise AssertionError("no error")
    except SaveFailed as exc:
        print("TIMED OUT", exc)
    assert time.monotonic() - start < 15 and not writer.is_alive() and slow.what is None
    weight.mul_(2.0)
    out = save("after", background)  # a failed save leaves nothing behind that a later one trips on
    background.finish("the test")  # and the host copies, reused, hold this save's values, not the first one's
    assert torch.equal(dist_checkpointing.load(empty, str(out))["w"], weight)
    print("COMMITTED", committed)
"""


def test_a_background_save_writes_the_state_at_its_start_and_fails_loudly(tmp_path):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT.format(root=str(tmp_path)))], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    free = "GiB free on the disk of"
    assert any(line.startswith("KILLED killed: not written: the background writer of rank 0 failed (its log says "
                               "how; ") and free in line for line in lines), lines
    assert any(line.startswith("TIMED OUT slow: not written: the background writer of rank 0 timed out (its log "
                               "says how; ") and free in line for line in lines), lines
    assert lines[-1] == "COMMITTED ['good', 'after']"
    gone = next(line for line in lines if line.startswith("GONE"))
    assert gone.startswith("GONE gone: not written: the background writer of rank 0 failed") and (
        f"{free} {tmp_path / 'gone'})" in gone), gone
    assert "exited with code -9" in proc.stderr and "was still writing after 1 s" in proc.stderr
