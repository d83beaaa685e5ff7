"""Fixtures of the rollout tests (the model and its helpers are in ``tests.rollout.tiny``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import save_hf_model
from tests.rollout.tiny import TINY


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 as a HF directory (version 0: no manifest)."""
    return save_hf_model(dict(TINY), tmp_path_factory.mktemp("rollout") / "tiny", seed=7)


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 as a scalar reward model (``tiny.CLASSIFIER``, seed 11) with a tokenizer (vLLM's pooling
    endpoints load one)."""
    from tests.helpers import with_tokenizer
    from tests.rollout.tiny import save_classifier

    return with_tokenizer(save_classifier(tmp_path_factory.mktemp("rollout") / "rm", seed=11))
