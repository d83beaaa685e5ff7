"""Corrupt, missing or mismatched inputs give an error that names the file/tensor/field, and leave no output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from checkpoint_tools import CheckpointError
from checkpoint_tools._convert import megatron_to_hf_dir
from checkpoint_tools._dist_write import hf_to_dist_dir
from checkpoint_tools._safetensors_stream import StreamingSafetensorsWriter
from megatron_offgrpo.model import UnsupportedConfigError
from tests.checkpoint.legacy_format import write_legacy_checkpoint
from tests.helpers import TOKENIZER_DIR


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"checkpoint_tools.{module}", *args], capture_output=True, text=True)


def copy_model(hf_models, tmp_path, name="qwen2_untied"):
    dst = tmp_path / "src"
    shutil.copytree(hf_models[name], dst)
    return dst


def test_truncated_safetensors_names_the_file_and_leaves_nothing(hf_models, tmp_path):
    src = copy_model(hf_models, tmp_path)
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    out = tmp_path / "out"
    proc = cli("hf_to_megatron", "--hf", str(src), "--out", str(out), "--tp", "2")
    assert proc.returncode == 2, proc.stderr
    assert "model.safetensors" in proc.stderr and "truncated or corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_missing_shard_names_the_file(hf_models, tmp_path):
    mega = write_legacy_checkpoint(hf_models["qwen3_untied"], tmp_path / "mega")
    hf = megatron_to_hf_dir(mega, tmp_path / "hf", max_shard_bytes=40_000)
    shards = sorted(hf.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        hf_to_dist_dir(hf, tmp_path / "again")
    assert not (tmp_path / "again").exists()
    # The same for an earlier version's per-rank checkpoint with a missing rank file.
    (mega / "mp_rank_00_000" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="mp_rank_00_000"):
        megatron_to_hf_dir(mega, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def test_bit_flip_is_caught_by_the_manifest_naming_the_tensor(hf_models, tmp_path):
    mega = write_legacy_checkpoint(hf_models["qwen2_tied"], tmp_path / "mega", tp=2)
    weights = mega / "mp_rank_01_000" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the last tensor's data; the header stays valid
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"mp_rank_01_000.*does not match the manifest"):
        megatron_to_hf_dir(mega, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_architecture_is_named(hf_models, tmp_path):
    src = copy_model(hf_models, tmp_path)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(
        json.dumps(dict(cfg, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"])))
    proc = cli("hf_to_megatron", "--hf", str(src), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "model_type='qwen2_moe'" in proc.stderr and "supported are" in proc.stderr
    (src / "config.json").write_text(json.dumps(dict(cfg, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(UnsupportedConfigError, match="yarn"):
        hf_to_dist_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_tp_not_dividing_heads_is_refused_before_writing(hf_models, tmp_path):
    proc = cli("hf_to_megatron", "--hf", str(hf_models["qwen2_untied"]), "--out", str(tmp_path / "out"), "--tp", "3")
    assert proc.returncode == 2
    assert "num_attention_heads=4 is not divisible by tp=3" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_crash_mid_export_leaves_no_output(hf_models, tmp_path, monkeypatch):
    mega = write_legacy_checkpoint(hf_models["qwen2_untied"], tmp_path / "mega", tp=2)
    calls = {"n": 0}
    real = StreamingSafetensorsWriter.write

    def failing_save(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError("disk full (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(StreamingSafetensorsWriter, "write", failing_save)
    with pytest.raises(OSError, match="simulated"):  # the 7th tensor: some HF shards are already written
        megatron_to_hf_dir(mega, tmp_path / "out", max_shard_bytes=40_000)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_existing_output_is_not_overwritten(hf_models, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        hf_to_dist_dir(hf_models["qwen2_untied"], tmp_path / "out")


def test_hf_checkpoint_missing_a_tensor_is_named(hf_models, tmp_path):
    from safetensors.torch import load_file, save_file

    src = copy_model(hf_models, tmp_path)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="model.layers.2.mlp.up_proj.weight"):
        hf_to_dist_dir(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert torch.is_tensor(tensors["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def dist_checkpoint(hf_models, tmp_path_factory):
    """``hf-to-megatron``'s output (Megatron-LM layout: tracker + release/) of a tiny Qwen2, written once."""
    return hf_to_dist_dir(hf_models["qwen2_untied"], tmp_path_factory.mktemp("dist") / "mega")


def _cut(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DIST_DAMAGE = {  # (what breaks the copy's release/ directory, the file named, what the line says)
    "truncated-distcp": (lambda d: _cut(d / "__0_1.distcp"), "__0_1.distcp", ": truncated: "),
    "missing-distcp": (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp", ": missing (the checkpoint's "),
    "truncated-metadata": (lambda d: _cut(d / ".metadata"), ".metadata", ": unreadable or corrupt (UnpicklingError"),
    "corrupt-megatron-metadata": (lambda d: (d / "metadata.json").write_text("{"), "metadata.json",
                                  ": unreadable or corrupt (JSONDecodeError"),
}


@pytest.mark.parametrize("case", sorted(DIST_DAMAGE))
def test_a_damaged_dist_checkpoint_is_one_line_from_train_and_convert(case, dist_checkpoint, hf_models, tmp_path,
                                                                      capsys):
    """``model.init=megatron`` (before any process group or run directory) and ``convert megatron-to-hf`` answer
    with the same line, naming the file, from the checkpoint's metadata alone."""
    from checkpoint_tools._check import dist_dir_errors
    from megatron_offgrpo.cli import main

    ckpt = tmp_path / "mega"
    shutil.copytree(dist_checkpoint, ckpt)
    breaks, name, says = DIST_DAMAGE[case]
    breaks(ckpt / "release")
    errors = dist_dir_errors(ckpt / "release")
    assert len(errors) == 1 and errors[0].startswith(f"{ckpt / 'release' / name}{says}"), errors
    out = tmp_path / "run"
    for argv in (["train", f"model.hf_path={hf_models['qwen2_untied']}", "model.init=megatron",
                  f"model.megatron_path={ckpt}", f"train.out_dir={out}", "rollout.max_new_tokens=16"],
                 ["convert", "megatron-to-hf", "--ckpt", str(ckpt), "--out", str(out)]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and errors[0] in err and "Traceback" not in err, err
        assert len(err.splitlines()) == (2 if argv[0] == "train" else 1), err
        assert not out.exists()
    assert dist_dir_errors(dist_checkpoint / "release") == []  # the intact one


def _tokenizer_without_vocab(d):  # tokenizer_config.json and friends, but no vocab.json / merges.txt
    for f in TOKENIZER_DIR.iterdir():
        if f.name not in ("vocab.json", "merges.txt", "SOURCES.md"):
            shutil.copy(f, d / f.name)


@pytest.mark.parametrize("breaks, says", [
    (_tokenizer_without_vocab, "its tokenizer encodes 'What is 2 + 3?' to no tokens"),
    (lambda d: (d / "tokenizer_config.json").write_text("{not json"), "its tokenizer does not load ("),
], ids=["no-vocab", "corrupt-config"])
def test_hf_to_megatron_refuses_a_tokenizer_train_and_eval_refuse(breaks, says, hf_models, tmp_path, capsys):
    """The checkpoint would carry the broken tokenizer files to every export: refused before converting, with the
    line train and eval give (``model.tokenizer_errors``)."""
    from megatron_offgrpo.cli import main

    src = copy_model(hf_models, tmp_path)
    breaks(src)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["convert", "hf-to-megatron", "--hf", str(src), "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"error: --hf={src}: {says}") and len(err.splitlines()) == 1, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
