"""One batch source per ``rollout.mode`` (``sampler._sources``), chosen once, and the one refresh decision
(``train._sync.step_refresh``); a checkpoint's rollout state written before the sources moved still loads. No engine:
a stub maker stands for ``BatchMaker`` (the sources use its ``generate`` and its stream's position only)."""

from __future__ import annotations

import threading
import zipfile

import pytest
import torch

from megatron_offgrpo.config import Config, RolloutConfig, TrainConfig
from megatron_offgrpo.data import Sample
from megatron_offgrpo.sampler._sampling import RolloutBatch
from megatron_offgrpo.sampler._sources import (AsyncSource, LockstepSource, PrefetchSource, RolloutState,
                                               make_source)
from megatron_offgrpo.train._checkpoint import ROLLOUT_STATE, load_rollout_state
from megatron_offgrpo.train._sync import StepRefresh, step_refresh


class Stream:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}


class Maker:
    """``BatchMaker``'s face to the sources: each generation draws 2 prompts."""

    def __init__(self) -> None:
        self.stream, self.generated = Stream(), []

    def generate(self, step: int, drawn=lambda: None) -> RolloutBatch:
        self.stream.position += 2
        drawn()
        self.generated.append(step)
        return RolloutBatch([Sample(f"p{step}", 0, [1], [2], [-0.1], 0, "stop")])


@pytest.mark.parametrize("mode, kind", [("lockstep", LockstepSource), ("overlap", PrefetchSource),
                                        ("async", AsyncSource), ("async_partial", AsyncSource)])
def test_the_mode_picks_its_source_once(mode, kind):
    source = make_source(RolloutConfig(mode=mode), Maker(), last=4, concurrent=False)
    assert isinstance(source, kind)
    source.stop()
    source.join(0.0)


def test_the_prefetch_generates_the_next_step_and_a_checkpoint_keeps_it():
    maker = Maker()
    source = PrefetchSource(maker, last=2)
    try:
        assert source.next_batch(0).samples[0].prompt_id == "p0"  # nothing prefetched: generated now
        source.start(1)
        state = source.resume_state()  # waits for the prefetch: kept, the stream past it
        assert list(state.ready) == [1] and state.stream == {"position": 4}
        assert source.next_batch(1) is state.ready[1]
        source.start(2)  # past the last step: nothing starts
        assert maker.generated == [0, 1]
    finally:
        source.stop()
        source.join(0.0)


def test_a_restored_batch_is_trained_first_in_lockstep():
    maker, batch = Maker(), RolloutBatch([])
    source = LockstepSource(maker)
    source.restore({3: batch})
    assert source.resume_state() == RolloutState({"position": 0}, {3: batch})
    assert source.next_batch(3) is batch and maker.generated == []
    source.next_batch(4)
    assert maker.generated == [4]


@pytest.mark.parametrize("partial", [False, True])
def test_only_async_partial_lets_a_refresh_in_beside_a_step_in_flight(partial):
    source = AsyncSource(Maker(), bound=1, last=4, concurrent=False, partial=partial)
    source.gate.enter_shared()  # a step generating
    entered = threading.Event()

    def refresh() -> None:
        with source.refresh_access():
            entered.set()

    thread = threading.Thread(target=refresh)
    thread.start()
    assert entered.wait(0.5) == partial  # async waits for the step in flight; async_partial comes in beside it
    source.gate.leave_shared()
    thread.join(5)
    assert entered.is_set() and not thread.is_alive()
    source.stop()
    source.join(0.0)


@pytest.mark.parametrize("mode, step, version, want", [
    ("lockstep", 3, 2, StepRefresh(False, False, False)),  # v = 2: one step since version 2
    ("lockstep", 4, 2, StepRefresh(True, False, False)),
    ("async", 4, 2, StepRefresh(True, False, False)),
    ("async_partial", 4, 2, StepRefresh(True, False, False)),
    ("overlap", 4, 2, StepRefresh(False, True, False)),  # its batch came from version 2: refreshed after it
    ("lockstep", 5, 4, StepRefresh(False, False, True)),  # the last step (steps=6), evaluated: the trained policy
])
def test_one_function_decides_each_refresh_of_a_step(mode, step, version, want):
    config = Config(rollout=RolloutConfig(mode=mode, refresh_every=2), train=TrainConfig(steps=6, eval_every=3))
    assert step_refresh(config, step, version) == want
    config.train.eval_every = 0
    assert not step_refresh(config, 5, 4).before_eval  # nothing evaluated: no refresh for it


def test_a_rollout_state_written_before_the_sources_moved_still_loads(tmp_path):
    """Earlier checkpoints pickled ``RolloutState`` as ``megatron_offgrpo.sampler._rollout_side.RolloutState``."""
    batch = RolloutBatch([Sample("p", 0, [1], [2], [-0.1], 3, "stop")], timing={"generate_s": 1.0})
    state = RolloutState({"position": 8, "epoch": 0}, {4: batch})
    RolloutState.__module__ = "megatron_offgrpo.sampler._rollout_side"
    try:
        torch.save(state, tmp_path / ROLLOUT_STATE)
    finally:
        RolloutState.__module__ = "megatron_offgrpo.sampler._sources"
    with zipfile.ZipFile(tmp_path / ROLLOUT_STATE) as archive:
        pickled = b"".join(archive.read(n) for n in archive.namelist() if n.endswith("data.pkl"))
    assert b"megatron_offgrpo.sampler._rollout_side" in pickled
    loaded = load_rollout_state(tmp_path, {})
    assert isinstance(loaded, RolloutState) and loaded.stream == state.stream
    assert loaded.ready[4].samples[0].policy_version == 3 and loaded.ready[4].timing == {"generate_s": 1.0}
