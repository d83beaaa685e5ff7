"""The megatron Qwen equals HF Qwen2ForCausalLM / Qwen3ForCausalLM in every parallel layout (fp32, <= 1e-5),
and the live streaming export returns the loaded HF tensors bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from checkpoint_tools import open_safetensors_dir
from tests.helpers import REPO, run_torchrun

WORKER = REPO / "tests" / "workers" / "model_worker.py"
LAYOUTS = [
    pytest.param(1, 1, id="tp1pp1"),
    pytest.param(2, 1, id="tp2", marks=pytest.mark.multiproc),
    pytest.param(1, 2, id="pp2", marks=pytest.mark.multiproc),
    pytest.param(2, 2, id="tp2pp2", marks=[pytest.mark.multiproc, pytest.mark.slow]),
]


def hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_and_streaming_export_match_hf(hf_models, tmp_path, tp, pp):
    run_torchrun(WORKER, tp * pp, ["--mode", "logits", "--tp", str(tp), "--pp", str(pp), "--out", str(tmp_path),
                                   "--hf", *map(str, hf_models.values())])
    for name, hf_dir in hf_models.items():
        saved = torch.load(tmp_path / f"{name}.logits.pt")
        expected = hf_logits(hf_dir, saved["ids"])
        assert saved["logits"].shape == expected.shape
        diff = (saved["logits"] - expected).abs().max().item()
        assert diff <= 1e-5, f"{name} tp={tp} pp={pp}: max |logits diff| {diff:.3g} > 1e-5"

        exported = {}
        for stage in range(pp):
            part = load_file(tmp_path / f"{name}.export.pp{stage}.safetensors")
            assert not set(part) & set(exported), "two stages exported the same tensor"
            exported.update(part)
        original = open_safetensors_dir(hf_dir)
        expected_names = set(original.names()) - ({"lm_head.weight"} if "_tied" in name else set())
        assert set(exported) == expected_names
        for key in expected_names:
            assert torch.equal(exported[key], original[key]), f"{name}: streamed {key} differs"
