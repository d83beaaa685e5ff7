"""rollout.mode=async (``sampler._async``): generation runs ahead of the trainer up to the staleness bound and pauses
there, batches are trained in the order their prompts were drawn, a generation error reaches the trainer, and a run
killed at any point and resumed trains every prompt of the stream exactly once (the checkpoint keeps the untrained
batches)."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest

from megatron_offgrpo.config import RolloutConfig
from megatron_offgrpo.data import Sample
from megatron_offgrpo.sampler._async import AsyncGenerator, EngineGate
from megatron_offgrpo.sampler._sampling import RolloutBatch
from megatron_offgrpo.sampler._builders import sampling_params
from tests.helpers import REPO
from tests.train.conftest import kill_tree, metrics, train_cmd, train_env, train_proc


class Recorder:
    """A generate function: one sample per step, tagged with the version the engine serves, recording the order the
    steps drew in; a step in ``hold`` waits for its event (a long generation)."""

    def __init__(self, fail_at: int | None = None, hold: dict[int, threading.Event] | None = None) -> None:
        self.version, self.started, self.fail_at, self.hold = 0, [], fail_at, hold or {}
        self.finished: list[int] = []

    def __call__(self, step: int, drawn) -> RolloutBatch:
        self.started.append(step)
        drawn()
        if step == self.fail_at:
            raise RuntimeError(f"engine died at step {step}")
        if step in self.hold:
            assert self.hold[step].wait(10)
        self.finished.append(step)
        return RolloutBatch([Sample(f"p{step}", 0, [1], [2], [-0.1], self.version, "stop", reward=1.0)])


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("concurrent", [False, True])
def test_generation_runs_ahead_to_the_bound_pauses_there_and_resumes_after_a_refresh(concurrent):
    gen = Recorder()
    producer = AsyncGenerator(gen, EngineGate(), bound=2, last=10, concurrent=concurrent)
    try:
        producer.set_version(0)
        assert producer.take(0).samples[0].prompt_id == "p0"
        _wait_for(lambda: gen.started == [0, 1, 2])  # steps 1 and 2 are within 2 of version 0: generated ahead
        time.sleep(0.2)
        assert gen.started == [0, 1, 2] and sorted(producer.ready_batches()) == [1, 2]  # paused at the bound
        gen.version = 2
        producer.set_version(2)  # the refresh: up to step 4 now
        _wait_for(lambda: gen.started == [0, 1, 2, 3, 4])
        batches = [producer.take(step) for step in (1, 2, 3, 4)]
        assert [b.samples[0].prompt_id for b in batches] == ["p1", "p2", "p3", "p4"]  # the draw order
        assert [b.samples[0].policy_version for b in batches] == [0, 0, 2, 2]
        assert all(step - b.samples[0].policy_version <= 2 for step, b in zip((1, 2, 3, 4), batches))
        assert batches[0].timing["buffer_depth"] == 3 and batches[0].timing["fleet_paused_s"] >= 0.2  # 2, 3, 4 behind
    finally:
        producer.close()


def test_a_concurrent_engine_generates_every_step_the_bound_allows_at_once_and_they_are_taken_in_step_order():
    """Step 0 is long: steps 1..3 start beside it (their requests share the engine's batch), finish first, and
    still reach the trainer after it; the draws are in step order; a fourth step waits for the bound."""
    release = threading.Event()
    gen = Recorder(hold={0: release})
    producer = AsyncGenerator(gen, EngineGate(), bound=3, last=10, concurrent=True)
    try:
        producer.set_version(0)
        taker = threading.Thread(target=producer.take, args=(0,), daemon=True)
        taker.start()
        _wait_for(lambda: sorted(gen.finished) == [1, 2, 3])  # in any order: they run side by side
        assert gen.started == [0, 1, 2, 3] and taker.is_alive()  # step 4 is 4 ahead of version 0: not started
        release.set()
        taker.join(10)
        assert [producer.take(step).samples[0].prompt_id for step in (1, 2, 3)] == ["p1", "p2", "p3"]
    finally:
        release.set()
        producer.close()


def test_one_step_at_a_time_on_an_engine_without_a_shared_batch():
    release = threading.Event()
    gen = Recorder(hold={0: release})
    producer = AsyncGenerator(gen, EngineGate(), bound=3, last=10, concurrent=False)
    try:
        producer.set_version(0)
        threading.Thread(target=producer.take, args=(0,), daemon=True).start()
        _wait_for(lambda: gen.started == [0])
        time.sleep(0.2)
        assert gen.started == [0]
    finally:
        release.set()
        producer.close()


def test_a_generation_error_is_raised_by_the_take_of_its_step():
    producer = AsyncGenerator(Recorder(fail_at=1), EngineGate(), bound=1, last=10, concurrent=True)
    try:
        producer.set_version(0)
        producer.take(0)
        with pytest.raises(RuntimeError, match="engine died at step 1"):
            producer.take(1)
        with pytest.raises(RuntimeError, match="engine died at step 1"):  # nothing after it was started
            producer.take(2)
    finally:
        producer.close()


def test_the_gate_holds_new_steps_while_a_refresh_waits_and_the_refresh_waits_for_the_steps_in_flight():
    release, gate = threading.Event(), EngineGate()
    gen = Recorder(hold={1: release})
    producer = AsyncGenerator(gen, gate, bound=2, last=10, concurrent=True)
    try:
        producer.set_version(0)
        producer.take(0)
        _wait_for(lambda: sorted(gen.finished) == [0, 2])  # step 1 is long, 2 done beside it; 3 is past the bound
        seen: list[tuple[list[int], list[int]]] = []

        def refresh() -> None:
            with gate.exclusive():  # what RolloutSide.install does
                time.sleep(0.1)
                seen.append((list(gen.started), sorted(producer.ready_batches())))

        refresher = threading.Thread(target=refresh, daemon=True)
        refresher.start()
        _wait_for(lambda: gate._exclusive_waiting == 1)
        producer.set_version(2)  # steps 3 and 4 are allowed now, but the waiting refresh holds them back
        time.sleep(0.2)
        assert gen.started == [0, 1, 2] and not seen  # the refresh waits for step 1
        release.set()
        refresher.join(10)
        assert seen == [([0, 1, 2], [1, 2])]  # it ran after step 1 ended, before step 3 began
        _wait_for(lambda: gen.started == [0, 1, 2, 3, 4])
    finally:
        release.set()
        producer.close()


def test_close_while_paused_at_the_bound_returns():
    producer = AsyncGenerator(Recorder(), EngineGate(), bound=0, last=10, concurrent=True)
    producer.set_version(0)
    producer.take(0)
    start = time.monotonic()
    producer.close()
    assert time.monotonic() - start < 5


def _offgrpo_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("offgrpo-")]


def test_close_joins_every_generation_thread_and_names_one_that_outlives_its_wait(caplog):
    """Every exit path joins the generation threads it started, each wait bounded: a step still generating when the
    wait runs out is named (and left behind, a daemon), and a later close joins it."""
    release = threading.Event()
    gen = Recorder(hold={1: release})
    producer = AsyncGenerator(gen, EngineGate(), bound=2, last=10, concurrent=True)
    producer.set_version(0)
    producer.take(0)
    _wait_for(lambda: sorted(gen.finished) == [0, 2])  # step 1 is mid-generation
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="megatron_offgrpo.sampler._async"):
        assert producer.close(0.3) == ["offgrpo-rollout-step-1"]
    assert time.monotonic() - start < 3
    assert "closing the async rollout: thread(s) offgrpo-rollout-step-1 still running" in caplog.text
    release.set()
    assert producer.close() == [] and _offgrpo_threads() == [] and gen.started == [0, 1, 2]  # none started after


def test_an_error_while_the_async_producer_generates_joins_every_thread(tiny_hf_dir, tmp_path):
    """The trainer fails (any error on the main thread) while the real rollout side generates step 1 ahead: the
    loop's error path closes it, and no thread it started outlives the error (one left inside the engine's native
    code at interpreter exit aborted the process: ``terminate called without an active exception``, exit 134)."""
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.sampler._rollout_side import RolloutSide
    from megatron_offgrpo.train.loop import _close_after_error
    from tests.train.conftest import TINY

    config = load_config(None, [*TINY, f"train.out_dir={tmp_path}", "rollout.mode=async", "train.steps=4",
                                "rollout.max_new_tokens=64"])
    side = RolloutSide.build(config, tiny_hf_dir, tmp_path, max_positions=512)
    side.source.verified(0)  # what verify() does once the engine serves the weights
    side.batch(0)
    _wait_for(lambda: 1 in side.source._generator._in_flight)  # step 1 generates (the bound is v = 1)
    _close_after_error(side, None)
    assert _offgrpo_threads() == []
    _close_after_error(side, None)  # every exit path closes: a second close is a no-op



@pytest.mark.parametrize("mode, priority", [("async", 7), ("async_partial", 7), ("lockstep", 0), ("overlap", 0)])
def test_async_steps_ask_the_engine_for_the_oldest_step_first(mode, priority):
    """Step s's requests carry priority s in async mode (several steps share the engine's batch: the one the trainer
    takes next is admitted first), 0 otherwise (any vLLM server takes it, with or without priority scheduling)."""
    rollout = RolloutConfig(mode=mode, refresh_every=4)
    assert sampling_params(rollout, seed=3, step=7).priority == priority


def test_token_staleness_weighs_each_token_by_the_version_that_sampled_it():
    from megatron_offgrpo.sampler._rollout_side import token_staleness_metrics

    partial = Sample("p", 0, [1], [2, 3, 4], [-0.1] * 3, 3, "stop", token_versions=[3, 4, 5])
    whole = Sample("q", 1, [1], [2, 3], [-0.1] * 2, 4, "stop")
    # at step 5: (2 + 1 + 0) + 2 x 1 over 5 tokens (one at staleness 0, three at 1, one at 2, none at 3); one sample
    # of two saw a refresh
    assert token_staleness_metrics([partial, whole], 5, 3) == {
        "token_staleness_mean": 1.0, "token_staleness_0": 0.2, "token_staleness_1": 0.6, "token_staleness_2": 0.2,
        "token_staleness_3": 0.0, "partial_fraction": 0.5}


def test_the_staleness_histograms_keep_a_fixed_number_of_keys_whatever_the_bound():
    """A bound of 1e9 made a key per value (no step in 300 s; at 1000 a 51 kB record): values 0..7 keep their own
    share, 8 and more share one key, for samples and for tokens alike."""
    from megatron_offgrpo.sampler._rollout_side import sample_metrics

    samples = [Sample(f"p{v}", 0, [1], [2], [-0.1], 100 - stale, "stop", reward=1.0) for v, stale in
               enumerate([0, 0, 3, 7, 8, 40])]  # at step 100: staleness 0, 0, 3, 7, 8, 40
    start = time.perf_counter()
    metrics = sample_metrics(samples, 100, 10**9)
    assert time.perf_counter() - start < 1.0
    for prefix in ("staleness_", "token_staleness_"):
        shares = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix) and k[len(prefix)].isdigit()}
        assert shares == {"0": 2 / 6, "1": 0.0, "2": 0.0, "3": 1 / 6, "4": 0.0, "5": 0.0, "6": 0.0, "7": 1 / 6,
                          "8plus": 2 / 6}
    assert metrics["staleness_max"] == 40
    small = sample_metrics(samples[:3], 100, 3)  # a bound below 8: one key per value, none for the tail
    assert [k for k in small if k.startswith("staleness_") and k[10].isdigit()] == [f"staleness_{k}" for k in range(4)]


B = 2  # train.samples_every=1 logs the first 2 groups of every step: all of them
ASYNC = ["rollout.prompts_per_step=2", "train.samples_every=1", "train.steps=8", "train.save_every=2",
         "rollout.refresh_every=2"]


def _trained_prompts(out) -> list[list[str]]:
    """Per step, the prompt ids of its groups (the last logged run of a step: a resumed run redoes some)."""
    by_step: dict[int, dict[int, str]] = {}
    for line in (out / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], {})
        if row["prompt_id"] not in by_step[row["step"]].values():
            by_step[row["step"]][len(by_step[row["step"]])] = row["prompt_id"]
    return [list(by_step[s].values()) for s in sorted(by_step)]


@pytest.mark.slow
def test_an_async_run_killed_after_a_checkpoint_resumes_and_trains_every_prompt_exactly_once(tmp_path):
    lockstep = tmp_path / "lockstep"
    train_proc(1, lockstep, *ASYNC)
    want = _trained_prompts(lockstep)  # the stream's prompts in draw order, B per step
    assert len(want) == 8 and all(len(step) == B for step in want)

    out = tmp_path / "async"
    cmd = train_cmd(1, out, *ASYNC, "rollout.mode=async")
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    checkpoint = out / "checkpoints" / "step_00000004" / "trainer_state.json"
    deadline = time.time() + 600
    while not checkpoint.exists():
        assert proc.poll() is None and time.time() < deadline, "the async run ended before its step-4 checkpoint"
        time.sleep(0.02)
    kill_tree(proc.pid)
    proc.wait()
    resumed = subprocess.run(cmd + ["train.resume=true"], cwd=REPO, env=train_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _trained_prompts(out) == want  # every prompt once, in the stream's order, across the kill
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(8))
    for r in records:  # the bound (max_staleness defaults to v = 2) held, before and after the resume
        assert 0 <= r["staleness_max"] <= 2 and r["policy_version"] == 2 * (r["step"] // 2)
        assert r["buffer_depth"] >= 0 and r["generate_s"] > 0 and r["fleet_paused_s"] >= 0


@pytest.mark.slow
def test_an_async_run_with_partial_rollouts_refreshes_between_decode_steps(tmp_path):
    """v = 1 (a refresh every step), generation-bound: 4 answers of up to 400 tokens a step (random weights rarely
    stop), whose decode steps take longer than training on them, so each refresh comes while the next step
    generates, which goes on under the new weights. Every step trains, the bound holds on each sample's oldest
    token, and the tokens after a refresh are fresher than the sample (``token_staleness_mean``)."""
    train_proc(1, tmp_path, "rollout.mode=async_partial", "rollout.engine=vllm",
               "rollout.refresh_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
               "rollout.max_new_tokens=400", "train.steps=4")
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(4))
    for r in records:
        assert 0 <= r["staleness_max"] <= 1 and r["token_staleness_mean"] <= r["staleness_mean"] + 1e-9
    assert any(r["partial_fraction"] > 0 for r in records), [r["partial_fraction"] for r in records]
    assert any(r["token_staleness_mean"] < r["staleness_mean"] for r in records)
