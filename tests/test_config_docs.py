"""`offgrpo config`: docs/config.md is the generated reference of every key, and a resolved config loads back as the
same config."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from megatron_offgrpo.cli.config import config_reference, key_docs
from megatron_offgrpo.config import Config, load_config
from tests.helpers import REPO


def test_docs_config_md_is_the_generated_reference():
    assert (REPO / "docs" / "config.md").read_text() == config_reference(), (
        "docs/config.md is stale: regenerate it with `offgrpo config --reference > docs/config.md`")


def test_the_reference_names_every_key_with_its_meaning():
    keys = {doc.key: doc for doc in key_docs()}
    root = Config()
    sections = {s.name: getattr(root, s.name) for s in dataclasses.fields(root)}
    expected = {f"{name}.{f.name}" for name, section in sections.items() for f in dataclasses.fields(section)}
    assert set(keys) == expected
    assert all(doc.doc for doc in keys.values()), [k for k, d in keys.items() if not d.doc]
    reference = config_reference()
    assert all(f"| `{key}` |" in reference for key in keys)
    assert "| `rollout.refresh_every` | `int` | `1` |" in reference  # type and default as the dataclass holds them


def _offgrpo_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "config", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_the_resolved_config_loads_back_as_itself(tmp_path):
    overrides = ["rollout.refresh_every=3", "algo.tis_cap=null", "optim.lr=2e-5"]
    out = _offgrpo_config("--config", "configs/tiny-cpu.yaml", *overrides)
    assert out.returncode == 0, out.stderr
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(out.stdout)
    assert load_config(resolved) == load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)


def test_a_bad_key_is_one_line_and_exit_2():
    out = _offgrpo_config("--config", "configs/tiny-cpu.yaml", "rollout.refresh_evry=3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("error: unknown config key 'rollout.refresh_evry'") and out.stderr.count("\n") == 1
