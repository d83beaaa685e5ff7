"""The `offgrpo convert` entry point: the round trip (main job) runs end to end on a tiny config."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import tiny_hf_config


def test_offgrpo_convert_roundtrip_on_tiny_config(tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_text(json.dumps(tiny_hf_config("qwen3", tied=True)))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_offgrpo.cli", "convert", "roundtrip", "--config", str(cfg_dir),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "round trip OK" in proc.stdout and "bit-exact" in proc.stdout
    assert (tmp_path / "work" / "hf_export" / "tokenizer_config.json").exists()


def test_offgrpo_unknown_command_lists_valid_ones():
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "convert", "nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "valid: hf-to-megatron, megatron-to-hf, roundtrip" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "trian"], capture_output=True, text=True)
    valid = "train, sft, rm, eval, report, fleet, config, recipes, convert"  # every sub-command, in the order of --help
    assert proc.returncode == 2 and f"error: unknown command 'trian'; valid: {valid}\n" in proc.stderr
