"""Qwen3-MoE in megatron-core equals HF ``Qwen3MoeForCausalLM`` in every parallel layout, EP included (fp32,
<= 1e-5); the live export gathers the experts over EP bit for bit; one optimizer step at EP=2 (DP=2) equals the
single-process step; an earlier version's per-rank checkpoint with the experts split over TP and EP exports to HF
bit-exactly at any layout."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from checkpoint_tools import open_safetensors_dir
from checkpoint_tools._convert import megatron_to_hf_dir  # the legacy per-rank reader, as tests.checkpoint's
from checkpoint_tools._mapping import hf_names
from megatron_offgrpo.model import UnsupportedConfigError, arch_from_hf_config, load_arch
from tests.checkpoint.legacy_format import write_legacy_checkpoint
from tests.helpers import REPO, run_torchrun, tiny_hf_config

WORKER = REPO / "tests" / "workers" / "model_worker.py"
LAYOUTS = [  # tp, pp, ep, etp (None: tp), processes
    pytest.param(1, 1, 1, None, 1, id="ep1"),
    pytest.param(1, 1, 2, None, 2, id="ep2", marks=pytest.mark.multiproc),
    pytest.param(2, 1, 1, None, 2, id="tp2", marks=pytest.mark.multiproc),
    pytest.param(1, 2, 1, None, 2, id="pp2", marks=pytest.mark.multiproc),
    # experts whole (etp=1) and spread over the two TP ranks (ep=2): EP spans TP, the usual large-MoE layout
    pytest.param(2, 1, 2, 1, 2, id="tp2-etp1-ep2", marks=pytest.mark.multiproc),
    pytest.param(2, 1, 2, None, 4, id="tp2ep2", marks=[pytest.mark.multiproc, pytest.mark.slow]),
]


def test_qwen3_moe_config_is_read_in_both_spellings():
    cfg = tiny_hf_config("qwen3_moe")
    arch = arch_from_hf_config(cfg)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_intermediate_size, arch.norm_topk_prob) == (4, 2, 32, True)
    assert arch.is_moe and arch.qk_norm and not arch.qkv_bias
    renamed = dict(cfg, num_local_experts=cfg.pop("num_experts"))  # transformers 5 may save this spelling
    assert arch_from_hf_config(renamed) == arch


@pytest.mark.parametrize("override,named", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_experts": 0}, "num_experts"),
])
def test_unrepresentable_moe_fields_are_named(override, named):
    with pytest.raises(UnsupportedConfigError, match=named):
        arch_from_hf_config(dict(tiny_hf_config("qwen3_moe"), **override))


def test_expert_layout_errors_name_the_field():
    arch = arch_from_hf_config(tiny_hf_config("qwen3_moe"))
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by ep=3"):
        arch.check_layout(1, 1, 3)
    with pytest.raises(ValueError, match=r"ep=2: expert parallelism needs a mixture-of-experts model"):
        arch_from_hf_config(tiny_hf_config("qwen3")).check_layout(1, 1, 2)


def _hf_logits(hf_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("tp,pp,ep,etp,nproc", LAYOUTS)
def test_logits_and_expert_export_match_hf(moe_models, tmp_path, tp, pp, ep, etp, nproc):
    split = ["--etp", str(etp)] if etp is not None else []
    run_torchrun(WORKER, nproc, ["--mode", "logits", "--tp", str(tp), "--pp", str(pp), "--ep", str(ep), *split,
                                 "--out", str(tmp_path), "--hf", *map(str, moe_models.values())])
    for name, hf_dir in moe_models.items():
        saved = torch.load(tmp_path / f"{name}.logits.pt")
        diff = (saved["logits"] - _hf_logits(hf_dir, saved["ids"])).abs().max().item()
        assert diff <= 1e-5, f"{name} tp={tp} pp={pp} ep={ep} etp={etp}: max |logits diff| {diff:.3g} > 1e-5"
        exported = {}
        for stage in range(pp):
            exported.update(load_file(tmp_path / f"{name}.export.pp{stage}.safetensors"))
        original = open_safetensors_dir(hf_dir)
        assert sorted(exported) == sorted(original.names())
        for key in original.names():
            assert torch.equal(exported[key], original[key]), f"{name}: streamed {key} differs"


def _global_expert_names(params: dict[str, torch.Tensor], ep_rank: int, per_rank: int) -> dict[str, torch.Tensor]:
    """An EP rank's parameters with local expert indices made global (EP rank r holds experts r*per_rank ..)."""
    def rename(name: str) -> str:
        return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * per_rank + int(m.group(1))}.",
                      name)
    return {rename(n): t for n, t in params.items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["adam", "distributed_adam"])
def test_ep2_step_equals_single_process(moe_models, tmp_path, distributed_optimizer):
    hf_dir = moe_models["qwen3_moe"]
    extra = ["--distributed-optimizer"] if distributed_optimizer else []
    run_torchrun(WORKER, 1, ["--mode", "dpstep", "--hf", str(hf_dir), "--out", str(tmp_path), *extra])
    run_torchrun(WORKER, 2, ["--mode", "dpstep", "--ep", "2", "--hf", str(hf_dir), "--out", str(tmp_path), *extra])
    single = load_file(tmp_path / "dpstep.dp1.ep0.safetensors")
    ep_ranks = [load_file(tmp_path / f"dpstep.dp2.ep{r}.safetensors") for r in range(2)]
    assert ep_ranks[0]["grad_norm"].item() == pytest.approx(single["grad_norm"].item(), rel=1e-5)
    merged = {**_global_expert_names(ep_ranks[1], 1, 2), **_global_expert_names(ep_ranks[0], 0, 2)}
    assert set(merged) == set(single)
    # The dense weights are replicated: EP rank 1's copy must equal rank 0's (DDP all-reduced them).
    for name, tensor in ep_ranks[1].items():
        if "local_experts" not in name and name != "grad_norm":
            assert torch.equal(tensor, ep_ranks[0][name]), f"{name}: EP ranks diverged"
    initial = open_safetensors_dir(hf_dir)["model.layers.0.mlp.experts.3.down_proj.weight"]
    moved = (single["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"] - initial).abs().max().item()
    assert moved > 5e-4, f"the step barely changed an expert ({moved:.3g})"
    for name in single:
        diff = (single[name] - merged[name]).abs().max().item()
        assert diff <= 5e-6, f"{name}: EP=2 differs from single-process by {diff:.3g}"


def test_legacy_moe_checkpoint_exports_experts_bit_exactly_at_any_tp_pp_ep(moe_models, tmp_path):
    hf_dir = moe_models["qwen3_moe"]
    source = open_safetensors_dir(hf_dir)
    write_legacy_checkpoint(hf_dir, tmp_path / "tp2pp2ep2", tp=2, pp=2, ep=2)
    assert (tmp_path / "tp2pp2ep2" / "mp_rank_01_001_001" / "model.safetensors").is_file()
    stack = load_file(tmp_path / "tp2pp2ep2" / "mp_rank_01_000_001" / "model.safetensors")
    # EP rank 1 holds experts 2, 3; TP rank 1 the second half of each expert's gate and up rows
    fc1 = stack["decoder.layers.0.mlp.experts.linear_fc1.weight"]
    assert fc1.shape == (2, 32, 64)
    assert torch.equal(fc1[1, :16], source["model.layers.0.mlp.experts.3.gate_proj.weight"][16:])
    assert torch.equal(fc1[1, 16:], source["model.layers.0.mlp.experts.3.up_proj.weight"][16:])
    write_legacy_checkpoint(hf_dir, tmp_path / "ep4", ep=4)  # one expert per EP rank, merged by concatenation only
    for layout in ("tp2pp2ep2", "ep4"):
        megatron_to_hf_dir(tmp_path / layout, tmp_path / f"{layout}.hf")
        exported = open_safetensors_dir(tmp_path / f"{layout}.hf")
        assert list(exported.names()) == hf_names(load_arch(hf_dir))
        for name in source.names():
            assert torch.equal(exported[name], source[name]), f"{layout}: {name}"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ep4.hf")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"


def test_production_recipe_layout_fits_qwen3_30b_a3b():
    """configs/qwen3-30b-a3b-gsm8k.yaml against the real model's architecture (its config ships as an asset)."""
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.model import transformer_config

    asset = REPO / "megatron_offgrpo" / "assets" / "qwen3-30b-a3b-config"
    config = load_config(REPO / "configs" / "qwen3-30b-a3b-gsm8k.yaml", [f"model.hf_path={asset}"])
    arch = load_arch(asset)
    assert 30.4e9 < arch.num_params() < 30.6e9  # the model card's 30.5 B
    tp, pp, ep = config.parallel.tp, config.parallel.pp, config.parallel.ep
    arch.check_layout(tp, pp, ep)
    trainer_gpus = 2 * 8  # the header's sbatch: 4 nodes of which FLEET_NODES=2 generate
    assert (trainer_gpus // (tp * pp)) % ep == 0, "ep must divide dp"
    megatron = transformer_config(arch, tp, pp, ep=ep, use_te=False, perform_initialization=False)
    assert (megatron.num_moe_experts, megatron.moe_router_topk, megatron.moe_ffn_hidden_size) == (128, 8, 768)
    assert megatron.moe_router_pre_softmax is False and megatron.expert_model_parallel_size == 16
    assert config.model.precision == "fp8" and config.optim.distributed_optimizer


def test_moe_with_tensor_parallelism_gets_sequence_parallelism():
    """megatron trains MoE layers with tp > 1 only under sequence parallelism (a ValueError at the first training
    forward otherwise): parallel.sequence_parallel=null turns it on there, and only there; the recipe check passes."""
    from megatron_offgrpo.config import load_config
    from megatron_offgrpo.model import transformer_config
    from megatron_offgrpo.preflight._checks import model_errors

    moe, dense = load_arch(REPO / "megatron_offgrpo" / "assets" / "tiny-qwen3-moe"), load_arch(
        REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2")
    layout = dict(use_te=False, perform_initialization=False)
    assert transformer_config(moe, 2, 1, **layout).sequence_parallel
    assert not transformer_config(moe, 1, 1, **layout).sequence_parallel
    assert not transformer_config(dense, 2, 1, **layout).sequence_parallel
    assert transformer_config(dense, 2, 1, sequence_parallel=True, **layout).sequence_parallel
    config = load_config(REPO / "configs" / "tiny-moe-cpu.yaml",
                         ["model.hf_path=megatron_offgrpo/assets/tiny-qwen3-moe", "parallel.tp=2", "parallel.ep=1",
                          "model.init=random"])  # the asset is a config only: no weights to check
    assert model_errors(config) == []
