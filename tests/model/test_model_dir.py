"""``model.hf_path`` as the docs promise it: a directory, a bundled asset from any working directory, or a hub id
(fetched when online; one line saying how to fix it when offline). No test here touches the network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest

from megatron_offgrpo.model import load_arch, resolve_model_dir
from megatron_offgrpo.model._arch import ASSETS, HUB_FILES
from tests.helpers import REPO

HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def _never(*args, **kwargs):
    raise AssertionError("the hub was asked")


def test_existing_path_is_kept_and_plain_missing_path_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _never)
    assert resolve_model_dir(tmp_path) == tmp_path
    missing = tmp_path / "nope" / "model"  # absolute: not an owner/name id, so the hub is not asked
    with pytest.raises(FileNotFoundError, match=f"^{missing}: no such file or directory \\(give a HF model directory"):
        resolve_model_dir(missing)
    with pytest.raises(FileNotFoundError, match="^runs/a/b: no such file"):
        load_arch("runs/a/b")


def test_bundled_asset_resolves_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _never)
    monkeypatch.chdir(tmp_path)  # recipes write megatron_offgrpo/assets/... relative to the repository root
    assert resolve_model_dir("megatron_offgrpo/assets/tiny-qwen2") == ASSETS / "tiny-qwen2"
    assert load_arch("megatron_offgrpo/assets/qwen2.5-0.5b-config").num_layers == 24
    with pytest.raises(FileNotFoundError, match="^megatron_offgrpo/assets/nope: no such file"):
        resolve_model_dir("megatron_offgrpo/assets/nope")


def test_hub_id_online_is_fetched_into_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_download(repo_id, allow_patterns=None, **kwargs):  # the network only: a local dir as the hub's files
        calls.append((repo_id, allow_patterns))
        snapshot = tmp_path / "cache" / repo_id.replace("/", "--")
        shutil.copytree(ASSETS / "qwen2.5-0.5b-config", snapshot, dirs_exist_ok=True)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir(HUB_ID) == tmp_path / "cache" / "Qwen--Qwen2.5-0.5B-Instruct"
    assert load_arch(HUB_ID).num_params() == 494_032_768
    assert calls == [(HUB_ID, HUB_FILES)] * 2
    assert {"*.json", "*.safetensors", "*.txt"} <= set(HUB_FILES)  # config, weights, tokenizer (merges.txt)


def _resolve_in_subprocess(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The real hub client in a fresh process (it reads HF_HUB_OFFLINE / HF_ENDPOINT at import), with an empty cache."""
    code = f"from megatron_offgrpo.model import resolve_model_dir; resolve_model_dir({HUB_ID!r})"
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_hub_id_offline_says_how_to_fix_it(tmp_path):
    proc = _resolve_in_subprocess(tmp_path, HF_HUB_OFFLINE="1")
    assert proc.returncode != 0
    assert _last_line(proc) == (
        f"FileNotFoundError: {HUB_ID}: not a local directory, and the HF hub cannot provide it "
        f"(HF_HUB_OFFLINE is set and it is not in the HF cache); on a machine with network run "
        f"`hf download {HUB_ID} --local-dir DIR` and pass that DIR instead")


def test_hub_id_without_network_says_how_to_fix_it(tmp_path):
    # a real refused connection (nothing listens on port 9 of this machine), not a mock
    proc = _resolve_in_subprocess(tmp_path, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert proc.returncode != 0
    assert "(the hub cannot be reached and it is not in the HF cache)" in _last_line(proc)
    assert f"`hf download {HUB_ID} --local-dir DIR`" in _last_line(proc)


def test_sft_recipe_runs_from_another_directory(tmp_path):
    """The acceptance test: a recipe naming bundled assets, run with another working directory (~10 s)."""
    offgrpo = Path(sys.executable).parent / "offgrpo"
    proc = subprocess.run([str(offgrpo), "sft", "--config", str(REPO / "configs" / "tiny-cpu-sft.yaml"),
                           "train.steps=1", f"train.out_dir={tmp_path / 'x'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert load_arch(tmp_path / "x" / "hf").num_layers == load_arch(ASSETS / "tiny-qwen2").num_layers
    assert (tmp_path / "x" / "hf" / "tokenizer_config.json").is_file()
