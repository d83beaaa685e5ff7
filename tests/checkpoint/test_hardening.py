"""Bad flags and dangerous --out values are one line, exit 2, and touch nothing; killed conversions are swept.

Every row runs through both entry points (``python -m checkpoint_tools.SUB`` and ``offgrpo convert SUB``) in
process, and the tree under tmp_path is compared file by file before and after: nothing written, nothing deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint_tools import CheckpointError
from checkpoint_tools._convert import MegatronCheckpoint
from checkpoint_tools._io import _owner_tag, sweep_stale_siblings
from tests.checkpoint.legacy_format import write_legacy_checkpoint
from tests.helpers import REPO, tiny_hf_config

SUBS = {"hf_to_megatron": "hf-to-megatron", "megatron_to_hf": "megatron-to-hf"}


@pytest.fixture
def tree(hf_models, tmp_path, monkeypatch) -> Path:
    """tmp_path/D holding a HF source ``hf``, a TP2 checkpoint_tools directory ``mega`` (the format of earlier
    versions, which megatron-to-hf still reads) and an unrelated ``notes.txt``;
    tmp_path/junk is someone's directory of other files."""
    import shutil

    monkeypatch.setattr("checkpoint_tools._cli.tune_cpu_memory", lambda: None)  # keep the test process's env as is
    monkeypatch.chdir(tmp_path)
    shutil.copytree(hf_models["qwen2_untied"], tmp_path / "D" / "hf")  # 4 heads, 2 KV heads, 4 layers, vocab 256
    write_legacy_checkpoint(tmp_path / "D" / "hf", tmp_path / "D" / "mega", tp=2)
    (tmp_path / "D" / "notes.txt").write_text("someone's notes")
    (tmp_path / "junk").mkdir()
    for name in ("a.txt", "b.txt", "c.txt", "d.txt"):
        (tmp_path / "junk" / name).write_text(name)
    return tmp_path


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` (hidden ones too) with its content hash."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def run_entry(entry: str, sub: str, args: list[str], capsys) -> tuple[int, str]:
    """Run one conversion in process through ``entry``; returns (exit code, stderr)."""
    import importlib

    from megatron_offgrpo.cli import main as offgrpo

    try:
        if entry == "offgrpo":
            offgrpo(["convert", SUBS[sub], *args])
        else:
            importlib.import_module(f"checkpoint_tools.{sub}").main(args)
        code = 0  # a module's main returns on success; offgrpo exits 0
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


ROWS = [  # (sub-command, arguments, what the one line must name)
    ("hf_to_megatron", "--hf D/hf --out out --tp -2", "argument --tp: -2 is not a valid parallel size"),
    ("hf_to_megatron", "--hf D/hf --out out --pp -1", "argument --pp: -1 is not a valid parallel size"),
    ("hf_to_megatron", "--hf D/hf --out out --tp 0", "argument --tp: 0 is not a valid parallel size"),
    ("hf_to_megatron", "--hf D/hf --out out --pp 0", "argument --pp: 0 is not a valid parallel size"),
    ("hf_to_megatron", "--hf D/hf --out out --tp two", "argument --tp: 'two' is not an integer"),
    ("hf_to_megatron", "--hf D/hf --out out --tp 3", "num_attention_heads=4 is not divisible by tp=3"),
    ("hf_to_megatron", "--hf D/hf --out out --tp 4", "num_key_value_heads=2 is not divisible by tp=4"),
    ("hf_to_megatron", "--hf D/hf --out out --pp 3", "num_hidden_layers=4 is not divisible by pp=3"),
    ("megatron_to_hf", "--ckpt D/mega --out D/mega --overwrite", "--out D/mega is the source checkpoint itself"),
    ("megatron_to_hf", "--ckpt D/mega --out D --overwrite", "--out D contains the source checkpoint D/mega"),
    ("megatron_to_hf", "--ckpt D/mega --out . --overwrite", "--out . contains the source checkpoint D/mega"),
    ("megatron_to_hf", "--ckpt D/mega --out D/mega/hf", "--out D/mega/hf is inside the source checkpoint D/mega"),
    ("megatron_to_hf", "--ckpt D/mega --out junk --overwrite", "--out junk holds files that are not a checkpoint"),
    ("megatron_to_hf", "--ckpt D/mega --out D/notes.txt --overwrite",
     "--out D/notes.txt exists and is not a directory"),
    ("megatron_to_hf", "--ckpt D/mega --out D/hf", "D/hf already exists: pass --overwrite"),
    ("hf_to_megatron", "--hf D/hf --out D/hf", "--out D/hf is the source checkpoint itself"),
    ("hf_to_megatron", "--hf D/hf --out D", "--out D contains the source checkpoint D/hf"),
    ("hf_to_megatron", "--hf D/hf --out D/hf/mega", "--out D/hf/mega is inside the source checkpoint D/hf"),
    ("hf_to_megatron", "--hf D/hf --out junk", "junk already exists: pass --overwrite"),
    ("hf_to_megatron", "--hf D/hf --out junk --overwrite", "--out junk holds files that are not a checkpoint"),
    ("hf_to_megatron", "--hf D/hf --out out --tp 2", "run `torchrun --nproc_per_node 2 -m checkpoint_tools"),
]


@pytest.mark.parametrize("entry", ["module", "offgrpo"])
@pytest.mark.parametrize(("sub", "args", "culprit"), ROWS, ids=[f"{s}:{a}" for s, a, _ in ROWS])
def test_bad_flags_and_outputs_are_one_line_exit_2_and_touch_nothing(tree, capsys, entry, sub, args, culprit):
    before = snapshot(tree)
    code, err = run_entry(entry, sub, args.split(), capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and culprit in lines[0], err
    assert snapshot(tree) == before  # no --out, no temporary sibling, the sources and D/notes.txt untouched


def test_overwrite_replaces_an_earlier_output_or_an_empty_directory(tree, capsys):
    for out in ("D/hf", "empty"):  # a HF directory (config.json) is an earlier output; so is an empty one
        (tree / "empty").mkdir(exist_ok=True)
        code, err = run_entry("module", "megatron_to_hf", ["--ckpt", "D/mega", "--out", out, "--overwrite"], capsys)
        assert code == 0, err
        assert (tree / out / "config.json").is_file() and (tree / out / "offgrpo_manifest.json").is_file()
    assert (tree / "D" / "mega" / "megatron_meta.json").is_file() and (tree / "D" / "notes.txt").is_file()


def test_trainer_checkpoint_run_dir_is_not_replaced_by_its_export(tree, capsys):
    step = tree / "run" / "checkpoints" / "step_00000002"  # megatron's files and the model card, nothing loaded
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    card = {"format": "megatron-offgrpo-dist/1", "hf_config": tiny_hf_config(), "params_dtype": "float32",
            "layout": {"tp": 1, "pp": 1, "dp": 1}}
    (step / "offgrpo_model.json").write_text(json.dumps(card))
    before = snapshot(tree)
    code, err = run_entry("offgrpo", "megatron_to_hf", ["--ckpt", "run", "--out", "run", "--overwrite"], capsys)
    assert code == 2 and "--out run contains the source checkpoint run/checkpoints/step_00000002" in err, err
    assert len(err.strip().splitlines()) == 1 and snapshot(tree) == before


def test_a_meta_file_with_an_impossible_layout_names_the_file(tree):
    meta = tree / "D" / "mega" / "megatron_meta.json"  # as the unchecked hf_to_megatron --tp -2 used to write
    meta.write_text(json.dumps(dict(json.loads(meta.read_text()), tp=-2)))
    with pytest.raises(CheckpointError, match=r"megatron_meta.json: tp=-2: the tensor-parallel size must be"):
        MegatronCheckpoint(tree / "D" / "mega")
    meta.write_text("{")
    with pytest.raises(CheckpointError, match=r"megatron_meta.json: corrupt"):
        MegatronCheckpoint(tree / "D" / "mega")


def test_subprocess_exit_code_and_stderr_are_one_line(tree):
    for argv in (["-m", "checkpoint_tools.hf_to_megatron", "--hf", "D/hf", "--out", "out", "--tp", "0"],
                 ["-m", "megatron_offgrpo.cli", "convert", "megatron-to-hf", "--ckpt", "D/mega", "--out", "D",
                  "--overwrite"]):
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tree / "out").exists() and (tree / "D" / "mega" / "offgrpo_manifest.json").is_file()


# A real conversion that stops once its shards are on disk, inside its temporary directory, and waits there.
_BLOCKED = """
import sys, time
from checkpoint_tools import _dist_write
from checkpoint_tools.hf_to_megatron import main
real = _dist_write._save
def save(*args):
    real(*args)
    print("writing", flush=True)
    time.sleep(300)
_dist_write._save = save
main(sys.argv[1:])
"""


def test_kill_9_leaves_a_temporary_directory_that_the_next_run_sweeps(tree):
    from checkpoint_tools._dist import checkpoint_kind

    args = ["--hf", "D/hf", "--out", "out"]
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED, *args], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "writing"
        left = list(tree.glob(f".out.tmp-{proc.pid}-*"))
        assert len(left) == 1 and list(left[0].rglob("*.distcp"))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()  # reaped: the PID is no longer running
    assert not (tree / "out").exists() and left[0].is_dir()
    host = _owner_tag().split("-")[1]
    kept = [tree / f".out.tmp-{os.getpid()}-{host}-0000beef",  # a live writer (this test process)
            tree / f".out.tmp-{proc.pid}-{'0' * 8 if host != '0' * 8 else '1' * 8}-0000beef"]  # another host's
    swept = [left[0], tree / f".out.tmp-{proc.pid}-0000cafe"]  # the killed one; the older name without a host
    for path in kept + swept[1:]:
        path.mkdir()
    again = subprocess.run([sys.executable, "-m", "checkpoint_tools.hf_to_megatron", *args], capture_output=True,
                           text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert checkpoint_kind(tree / "out") == "dist"
    assert all(p.is_dir() for p in kept) and not any(p.exists() for p in swept)


def test_an_old_copy_is_swept_only_once_its_replacement_is_in_place(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out = tmp_path / "hf"
    old = tmp_path / f".hf.old-{dead.pid}-{_owner_tag().split('-')[1]}-0000beef"
    old.mkdir()  # killed between renaming hf away and renaming the new one in: the only copy
    assert sweep_stale_siblings(out) == [] and old.is_dir()
    out.mkdir()
    assert sweep_stale_siblings(out) == [old] and not old.exists()
