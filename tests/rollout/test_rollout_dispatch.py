"""Spreading groups over servers with retries and failover (fake servers: no vLLM, no sockets)."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_offgrpo.rollout._dispatch import HealthWatch, RetryPolicy, ServerPool, run_groups, unless_given_up
from megatron_offgrpo.rollout._errors import FleetError
from megatron_offgrpo.fleet import json_http
from megatron_offgrpo.rollout._samples import BadResponse

FAST = RetryPolicy(backoff_s=0.001, max_backoff_s=0.002, max_inflight_per_server=2)


def test_every_group_once_in_order_and_spread():
    pool = ServerPool(["a", "b"], FAST.dead_after)
    used = []

    def send(server, index):
        used.append(server)
        time.sleep(0.01)
        return (index, server)

    out = run_groups(pool, FAST, 10, send)
    assert [i for i, _ in out] == list(range(10))
    assert set(used) == {"a", "b"}  # least-loaded choice uses both


def test_dead_server_fails_over_without_duplicates():
    pool = ServerPool(["a", "b"], dead_after=1)
    calls = {"a": 0, "b": 0}
    lock = threading.Lock()

    def send(server, index):
        with lock:
            calls[server] += 1
        if server == "b":
            raise json_http.ServerDown("connection reset")
        time.sleep(0.02)  # a is busy: the least-loaded choice sends work to b too
        return (index, server)

    out = run_groups(pool, FAST, 12, send)
    assert out == [(i, "a") for i in range(12)]  # all 12 groups, each once, all from the live server
    # b is dead after its first failure; only the groups already sent to it (at most the 4 threads) reached it
    assert "b" in pool.dead and 1 <= calls["b"] <= 4


def test_retry_on_bad_answer_then_succeeds_elsewhere():
    pool = ServerPool(["a", "b"], dead_after=2)
    seen = []

    def send(server, index):
        seen.append(server)
        if len(seen) == 1:
            raise BadResponse("mixed versions")
        return server

    assert run_groups(pool, FAST, 1, send) == [seen[1]] and seen[0] != seen[1]
    assert not pool.dead  # a bad answer is not a dead server


def test_rejected_request_is_not_retried():
    pool = ServerPool(["a", "b"], dead_after=2)
    with pytest.raises(FleetError, match="rejected by server"):
        run_groups(pool, FAST, 1, lambda s, i: (_ for _ in ()).throw(json_http.RequestRejected("HTTP 401", 401)))


def test_all_dead_gives_a_clear_error():
    pool = ServerPool(["a", "b"], dead_after=1)
    with pytest.raises(FleetError, match="failed on every attempt|no serving server"):
        run_groups(pool, FAST, 3, lambda s, i: (_ for _ in ()).throw(json_http.ServerDown("refused")))
    assert set(pool.dead) == {"a", "b"}


def test_benched_servers_get_no_work_until_restored():
    pool = ServerPool(["a", "b"], dead_after=2)
    pool.bench("b", "refresh failed")
    assert {s for _, s in run_groups(pool, FAST, 6, lambda s, i: (i, s))} == {"a"}
    pool.restore("b")
    assert pool.serving() == ["a", "b"]


def test_backoff_grows_and_is_bounded():
    policy = RetryPolicy(backoff_s=1.0, max_backoff_s=4.0, jitter=0.0)
    assert [policy.delay(a) for a in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 4.0]
    with pytest.raises(ValueError, match="max_attempts=0 must be >= 1"):
        RetryPolicy(max_attempts=0)


def test_a_frozen_server_found_by_its_health_checks_loses_its_groups_to_the_others_in_seconds():
    """Server "a" holds every request it gets without a word (frozen: no reset, no answer) and fails its health
    checks: two failed checks mark it dead, the groups waiting on it give their requests up and go to "b", each
    once; without the checks they would wait for the request's read timeout."""
    policy = RetryPolicy(backoff_s=0.001, max_backoff_s=0.002, max_inflight_per_server=4, health_every_s=0.1,
                         health_timeout_s=0.1)
    pool = ServerPool(["a", "b"], policy.dead_after)
    thaw = threading.Event()  # the frozen server's requests return only once the test ends

    def send(server, index):
        if server == "a":  # given up as a fleet's ServerClient gives up its calls
            return unless_given_up(lambda: pool.why_dead("a"), lambda: (thaw.wait(30), (index, "a, thawed"))[1])
        return (index, server)  # ("a, thawed": an abandoned request's late answer, never to be used)

    def check(server, timeout):
        if server == "a":
            raise json_http.ServerDown(f"GET /health: ReadTimeout after {timeout} s")

    watch = HealthWatch(pool, check, policy)
    start = time.monotonic()
    try:
        with watch.watching():
            out = run_groups(pool, policy, 8, send)
    finally:
        thaw.set()
    assert time.monotonic() - start < 5  # two checks 0.1 s apart, not the 30 s a request would wait
    assert out == [(i, "b") for i in range(8)]
    assert "a" in pool.dead and "health checks" in pool.why_dead("a")
    pool.restore("a")
    assert pool.why_dead("a") is None and pool.serving() == ["a", "b"]


def test_a_server_out_of_rotation_is_checked_too_and_a_call_on_a_dead_one_is_given_up():
    """A refresh also waits on servers out of rotation (it repairs them), so the checks cover every server not
    dead; a call already waiting on a server is given up once it is marked dead, one to a dead server is not sent."""
    policy = RetryPolicy(health_every_s=0.05, health_timeout_s=0.05)
    pool = ServerPool(["a", "b"], policy.dead_after)
    pool.bench("a", "a failed refresh")
    checked = set()

    def check(server, timeout):
        checked.add(server)
        if server == "a":
            raise json_http.ServerDown("GET /health: ReadTimeout")

    thaw = threading.Event()
    start = time.monotonic()
    try:
        with HealthWatch(pool, check, policy).watching(), pytest.raises(json_http.ServerDown,
                                                                         match="in flight.*health checks"):
            unless_given_up(lambda: pool.why_dead("a"), lambda: thaw.wait(30))
    finally:
        thaw.set()
    assert time.monotonic() - start < 5 and checked == {"a", "b"} and pool.alive() == ["b"]
    sent = []
    with pytest.raises(json_http.ServerDown, match="not sent"):
        unless_given_up(lambda: pool.why_dead("a"), lambda: sent.append("a"))
    assert not sent


def test_health_checks_run_only_while_a_generation_is_in_flight():
    checked = []
    policy = RetryPolicy(health_every_s=0.05)
    watch = HealthWatch(ServerPool(["a"], 2), lambda server, timeout: checked.append(server), policy)
    with watch.watching():
        time.sleep(0.3)
    assert checked  # checked while watching
    time.sleep(0.2)  # the thread sees no watcher and ends
    count = len(checked)
    time.sleep(0.3)
    assert len(checked) == count and watch._thread is None
    with pytest.raises(ValueError, match="health_timeout_s=0 must be > 0"):
        RetryPolicy(health_timeout_s=0)
