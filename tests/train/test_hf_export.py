"""The trained policy as Hugging Face weights: every `offgrpo train` writes RUN/hf (and RUN/exports/step_N every
train.export_every), and `offgrpo convert megatron-to-hf` exports a trainer checkpoint of any layout in one process.
Both score a probe like the trainer scores it with the same weights (tests/workers/hf_export_worker.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, run_torchrun

WORKER = REPO / "tests" / "workers" / "hf_export_worker.py"
TOL = 1e-5  # fp32 on both sides; measured max |HF - trainer| is printed by the assertion


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "convert", "megatron-to-hf", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def hf_logprobs(hf_dir: Path, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]), t >= 1, under the HF model at ``hf_dir`` (fp32, as transformers loads it)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", [["parallel.tp=2"], ["parallel.pp=2", "optim.distributed_optimizer=true"]],
                         ids=["tp2", "pp2-distopt"])
def test_run_exports_and_converted_checkpoint_score_like_the_trainer(tmp_path, layout):
    import transformers

    run = tmp_path / "run"
    run_torchrun(WORKER, 2, [str(run), "train.steps=2", "train.export_every=1", *layout], timeout=600)
    probe = json.loads((run / "trainer_probe.json").read_text())
    ckpt = Path(probe["checkpoint"])
    assert ckpt.name == "step_00000002" and (ckpt / "offgrpo_model.json").is_file()
    tp = 2 if "parallel.tp=2" in layout else 1
    assert json.loads((ckpt / "offgrpo_model.json").read_text())["layout"] == {"tp": tp, "pp": 2 // tp, "dp": 1,
                                                                                "ep": 1, "etp": tp}
    out = tmp_path / "converted"
    proc = convert("--ckpt", str(ckpt), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = torch.tensor(probe["logp"], dtype=torch.float64)
    for hf_dir in (run / "hf", out):
        err = (hf_logprobs(hf_dir, probe["probe"]) - expected).abs().max().item()
        print(f"{layout} {hf_dir.name}: max |HF - trainer| log-prob {err:.2e}")  # shown with -s
        assert err <= TOL, f"{hf_dir}: max |HF - trainer| log-prob {err:.2e} > {TOL}"
        assert transformers.AutoTokenizer.from_pretrained(hf_dir).eos_token_id is not None
        assert (hf_dir / "generation_config.json").is_file()
    final, converted = weights(run / "hf"), weights(out)
    assert final.keys() == converted.keys() and all(torch.equal(final[k], converted[k]) for k in final)
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 151645  # the source's token ids
    # export_every=1 over 2 steps: step 1 under exports/, the last step is RUN/hf only
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_00000001"]
    first = weights(run / "exports" / "step_00000001")
    assert first.keys() == final.keys() and any(not torch.equal(first[k], final[k]) for k in final)
    if "parallel.tp=2" in layout:  # once is enough: a checkpoint missing a rank's shard file
        broken = tmp_path / "broken"
        shutil.copytree(ckpt, broken)
        next(broken.glob("*.distcp")).unlink()
        proc = convert("--ckpt", str(broken), "--out", str(tmp_path / "none"))
        assert proc.returncode == 2 and "error: " in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        # checkpoint_tools.checks.dist_dir_errors: the file the metadata names, found missing before any load
        assert ".distcp: missing (the checkpoint's .metadata places" in proc.stderr and not (tmp_path / "none").exists()


def test_bad_ckpt_is_one_line_exit_2_and_no_output(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("not a checkpoint")
    out = tmp_path / "out"
    proc = convert("--ckpt", str(tmp_path / "junk"), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(tmp_path / "junk") in lines[0], proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_checkpoint_tools_format_of_earlier_versions_still_converts(tmp_path):
    from tests.checkpoint.legacy_format import write_legacy_checkpoint
    from tests.helpers import save_hf_model, tiny_hf_config

    src = save_hf_model(tiny_hf_config("qwen2", tied=True, layers=2), tmp_path / "src")
    mega = write_legacy_checkpoint(src, tmp_path / "mega", tp=2, pp=2)
    proc = convert("--ckpt", str(mega), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert weights(tmp_path / "hf").keys() == weights(src).keys()


def test_ckpt_kind_errors_name_the_path_and_the_fix(tmp_path):
    from checkpoint_tools import CheckpointError, dist_ckpt

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="a run directory without a complete checkpoint"):
        dist_ckpt.checkpoint_kind(run)
    with pytest.raises(CheckpointError, match="not a megatron checkpoint"):
        dist_ckpt.checkpoint_kind(tmp_path / "missing")
    older = run / "checkpoints" / "step_00000002"
    (older / "metadata.json").write_text("{}")  # megatron's files, but no card: saved before HF export existed
    assert dist_ckpt.checkpoint_kind(older) == "dist"
    # a run: its newest complete save
    assert dist_ckpt.checkpoint_kind(run) == "dist" and dist_ckpt.resolve_checkpoint(run) == older
    (run / "checkpoints" / "step_00000004.tmp").mkdir()  # an unfinished later save is passed over
    (run / "checkpoints" / "step_00000004.tmp" / "metadata.json").write_text("{}")
    assert dist_ckpt.resolve_checkpoint(run) == older
    with pytest.raises(CheckpointError, match="offgrpo_model.json: missing"):
        dist_ckpt.dist_checkpoint_to_hf_dir(older, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_every_must_not_be_negative():
    from megatron_offgrpo.config import load_config

    with pytest.raises(ValueError, match=r"train.export_every=-1: must be >= 0"):
        load_config(None, ["model.hf_path=megatron_offgrpo/assets/tiny-qwen2", "train.export_every=-1"])
    assert load_config(None, ["model.hf_path=x", "train.export_every=5"]).train.export_every == 5
