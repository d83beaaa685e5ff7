"""benchmarks/async_rollout.py's own arithmetic: the long-tailed caps it writes (a data row's ``max_new_tokens``, read
back by the real loader) and the table row it computes from a run's metrics."""

from __future__ import annotations

import importlib.util
import math

from megatron_offgrpo.data import records
from tests.helpers import REPO

spec = importlib.util.spec_from_file_location("async_rollout", REPO / "benchmarks" / "async_rollout.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_long_tail_caps_are_log_normal_within_bounds_and_load_as_row_caps(tmp_path):
    path = tmp_path / "d.jsonl"
    quantiles = bench.long_tail_data(path, 2000, median=24.0, sigma=0.9, most=192, seed=0)
    caps = sorted(r.max_new_tokens for r in records.load_local(path))
    assert len(caps) == 2000 and caps[0] >= 1 and caps[-1] == quantiles["max"] <= 192
    assert abs(quantiles["median"] - 24) <= 3  # the log-normal's median
    assert quantiles["p90"] > 2 * quantiles["median"]  # a long tail: p90 of exp(1.28 sigma) = 3.2x the median
    assert math.isclose(quantiles["p90"], caps[1800])


def test_a_runs_row_leaves_step_0_out_and_reads_the_async_columns():
    records = [{"step": s, "wall_s": 10.0 + 2 * s, "response_len": 10.0, "time_train_s": 1.5, "generate_s": 3.0,
                "time_generate_s": 0.5, "staleness_mean": 1.0, "steps_in_flight": 2, "fleet_paused_s": 0.25}
               for s in range(5)]
    row = bench.summarise(records, "async", 4, samples_per_step=64)
    assert row["tokens/s"] == round(4 * 10 * 64 / 8, 1) and row["trainer busy"] == "75%"
    assert row["generation busy"] == "150%" and row["steps in flight"] == 2 and row["paused by bound s/step"] == 0.25


def test_samples_per_step_follow_the_runs_overrides():
    assert bench.samples_per_step([]) == 8 * 8  # configs/tiny-cpu.yaml
    assert bench.samples_per_step(["rollout.prompts_per_step=2", "optim.packing=true"]) == 2 * 8


def test_cpu_seconds_count_this_process_work():
    import os
    import time

    before, start = bench._cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.3:  # busy
        pass
    assert 0.2 <= bench._cpu_seconds(os.getpid()) - before <= 1.0
