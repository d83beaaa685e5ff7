"""What a process pays at its end: no full garbage collection in the in-process vLLM engine's shutdown on CPU
(``VllmCore.shutdown``), which walks every object of a process holding torch, megatron-core and vLLM."""

from __future__ import annotations

import gc


def test_full_collections_are_skipped_inside_the_shutdown_guard_and_restored_after():
    from megatron_offgrpo.rollout._vllm_core import _full_collections_skipped

    collect = gc.collect
    full_before = gc.get_stats()[2]["collections"]
    with _full_collections_skipped():
        assert gc.collect() == 0 and gc.collect(2) == 0
        assert gc.get_stats()[2]["collections"] == full_before
    assert gc.collect is collect
    gc.collect()
    assert gc.get_stats()[2]["collections"] == full_before + 1
