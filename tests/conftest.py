"""Test session fixtures: tiny random HF Qwen models shared by the model and checkpoint tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests run on the CPU build; keep each process to one thread so multi-process tests do not oversubscribe 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["tests._budget"]  # the suite's time budget: heavy files first, the wall time printed and checked

VARIANTS = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]


def variant_name(model_type: str, tied: bool) -> str:
    return f"{model_type}_{'tied' if tied else 'untied'}"


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Four tiny random HF checkpoints: Qwen2/Qwen3 x tied/untied embeddings."""
    from tests.helpers import save_hf_model, tiny_hf_config

    root = tmp_path_factory.mktemp("hf")
    return {
        variant_name(mt, tied): save_hf_model(tiny_hf_config(mt, tied), root / variant_name(mt, tied), seed=i)
        for i, (mt, tied) in enumerate(VARIANTS)
    }


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """Two tiny random Qwen3-MoE checkpoints: top-k probabilities renormalised (Qwen3's default) and not."""
    from tests.helpers import save_hf_model, tiny_hf_config

    root = tmp_path_factory.mktemp("hf_moe")
    return {
        name: save_hf_model(dict(tiny_hf_config("qwen3_moe"), norm_topk_prob=norm), root / name, seed=10 + i)
        for i, (name, norm) in enumerate([("qwen3_moe", True), ("qwen3_moe_unnormed", False)])
    }
