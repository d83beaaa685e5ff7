"""A call into an engine process that dies ends at once with one line naming the process (vLLM alone waits forever)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time

import pytest

from megatron_offgrpo.rollout._errors import EngineDiedError
from megatron_offgrpo.rollout._liveness import call_while_alive


def _child() -> None:
    time.sleep(120)


@pytest.fixture
def child():
    process = multiprocessing.get_context("spawn").Process(target=_child, daemon=True)
    process.start()
    yield process
    if process.is_alive():
        process.kill()
    process.join()


@pytest.mark.parametrize("how,reason", [(signal.SIGKILL, "killed by SIGKILL"), (signal.SIGTERM, "killed by SIGTERM")])
def test_a_call_waiting_on_a_dead_engine_ends_with_one_line(child, how, reason):
    threading.Timer(0.5, os.kill, (child.pid, how)).start()
    start = time.monotonic()
    with pytest.raises(EngineDiedError) as err:
        call_while_alive([child], threading.Event().wait)  # vLLM's wait for an answer that never comes
    assert time.monotonic() - start < 5
    assert str(err.value) == (f"the vLLM engine process (pid {child.pid}) died: {reason}; the run stops here "
                              "(--resume continues from its last checkpoint)")
    assert "\n" not in str(err.value)
    again = pickle.loads(pickle.dumps(err.value))  # rank 0 broadcasts it: the other ranks raise the same line
    assert type(again) is EngineDiedError and str(again) == str(err.value)
    with pytest.raises(EngineDiedError):  # dead already: refused before the call starts
        call_while_alive([child], lambda: pytest.fail("called"))


def test_a_live_engine_answers_and_its_errors_pass_through(child):
    assert call_while_alive([child], lambda: 42) == 42
    with pytest.raises(ValueError, match="bad"):
        call_while_alive([child], lambda: (_ for _ in ()).throw(ValueError("bad")))
    assert call_while_alive([], lambda: "in-process") == "in-process"  # no processes to watch: called directly
