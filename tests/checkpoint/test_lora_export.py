"""LoRA adapters out of megatron (issue 49): megatron's factors -> PEFT's, the merged HF weights, the PEFT directory
that ``peft.PeftModel.from_pretrained`` loads, and the streaming export of a live model (merged or adapter only).

The oracle everywhere is ``W + s B A`` on whole megatron tensors, named by the base weight map alone
(``lora_fixture.merged_hf``); PEFT's forward on the base must equal the HF forward of that merge (fp32, 1e-5).
"""

from __future__ import annotations

import json

import pytest
import torch

from checkpoint_tools import adapters, dist_ckpt
from megatron_offgrpo.model import arch_from_hf_config
from tests.checkpoint.lora_fixture import ALL, ATTENTION, full_adapters, merged_hf, peft_pairs
from tests.helpers import make_hf_model, tiny_hf_config

CASES = {  # name: (model type, tied, targets)
    "qwen2": ("qwen2", True, ALL),
    "qwen3": ("qwen3", False, ALL),
    "qwen3_moe": ("qwen3_moe", False, ATTENTION),
}


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(ids).logits.double(), dim=-1)


@pytest.mark.parametrize("case", list(CASES))
def test_a_peft_adapter_on_the_base_is_the_merged_model(tmp_path, case):
    """PEFT's q/k/v (gate/up) adapters with one shared A and B split as the base weight compute exactly what megatron's
    fused adapter does: ``W_q + s B_q A`` are the q rows of ``W_qkv + s B A``."""
    from peft import PeftModel

    model_type, tied, targets = CASES[case]
    cfg = tiny_hf_config(model_type, tied=tied, layers=2)
    arch = arch_from_hf_config(cfg)
    card = adapters.LoraCard(rank=4, alpha=8.0, targets=targets)
    fulls = full_adapters(arch, card, seed=1)
    base = make_hf_model(cfg, seed=3)
    merged = make_hf_model(cfg, seed=3)
    merged.load_state_dict(merged_hf(base.state_dict(), arch, card, fulls), strict=True)
    out = adapters.write_peft(tmp_path / "adapter", card, arch, peft_pairs(arch, fulls), base_model="tiny")
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"], config["bias"]) == (4, 8, "LORA", "none")
    peft = PeftModel.from_pretrained(base, out).eval()
    ids = torch.randint(0, cfg["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    want, got = _log_probs(merged, ids), _log_probs(peft, ids)
    assert (want - _log_probs(make_hf_model(cfg, seed=3), ids)).abs().max() > 1e-2  # the adapter changes the model
    assert (got - want).abs().max() < 1e-5


def test_the_peft_names_and_shapes_of_each_target():
    arch = arch_from_hf_config(tiny_hf_config("qwen2", layers=2))  # 4 heads, 2 KV groups, head 16, inter 96
    card = adapters.LoraCard(rank=3, alpha=3.0, targets=ALL)
    assert adapters.peft_target_modules(card, arch) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]
    a, b = torch.randn(3, 64), torch.randn(2 * 32 + 64, 3)  # qkv rows: 2 groups x (2 q heads + k + v) x 16
    pairs = dict(adapters.adapter_to_peft("decoder.layers.1.self_attention.linear_qkv.lora.weight_a", a, arch, 0))
    stem = "base_model.model.model.layers.1.self_attn"
    assert list(pairs) == [f"{stem}.{p}.lora_A.weight" for p in ("q_proj", "k_proj", "v_proj")]
    assert all(t is a for t in pairs.values())  # one A for the three
    pairs = dict(adapters.adapter_to_peft("decoder.layers.0.self_attention.linear_qkv.lora.weight_b", b, arch, 1))
    q, k, v = (pairs[f"{stem}.{p}.lora_B.weight"] for p in ("q_proj", "k_proj", "v_proj"))
    # group g's rows are [q_g (32 rows), k_g (16), v_g (16)]: q is rows 0-31 and 64-95, k 32-47 and 96-111
    assert torch.equal(q, torch.cat([b[0:32], b[64:96]])) and torch.equal(k, torch.cat([b[32:48], b[96:112]]))
    assert torch.equal(v, torch.cat([b[48:64], b[112:128]]))
    b_fc1 = torch.randn(2 * 96, 3)
    pairs = dict(adapters.adapter_to_peft("decoder.layers.0.mlp.linear_fc1.lora.weight_b", b_fc1, arch))
    assert torch.equal(pairs["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"], b_fc1[:96])
    assert torch.equal(pairs["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"], b_fc1[96:])
    a_fc2 = torch.randn(3, 96)
    assert adapters.adapter_to_peft("decoder.layers.1.mlp.linear_fc2.lora.weight_a", a_fc2, arch) == [
        ("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight", a_fc2)]
    shapes = adapters.peft_shapes(card, arch)
    assert shapes[f"{stem}.q_proj.lora_A.weight"] == (3, 64) and shapes[f"{stem}.k_proj.lora_B.weight"] == (32, 3)
    assert shapes["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == (3, 96)
    assert len(shapes) == 2 * 2 * 7


def test_factors_split_over_tp_as_their_base_weight_does():
    split = {t: (adapters.adapter_split(f"decoder.layers.0.{p}.lora.weight_a"),
                 adapters.adapter_split(f"decoder.layers.0.{p}.lora.weight_b")) for t, p in adapters.TARGETS.items()}
    assert split == {"linear_qkv": ("replicated", "rows"), "linear_fc1": ("replicated", "gate_up"),
                     "linear_proj": ("cols", "replicated"), "linear_fc2": ("cols", "replicated")}


@pytest.mark.parametrize("name", [
    "decoder.layers.0.self_attention.linear_qkv.lora.weight_c",
    "decoder.layers.0.input_layernorm.lora.weight_a",
    "output_layer.lora.weight_b",
    "decoder.layers.0.mlp.experts.linear_fc1.lora.weight_a",
])
def test_an_unknown_adapter_name_is_refused_by_name(name):
    arch = arch_from_hf_config(tiny_hf_config("qwen2", layers=2))
    with pytest.raises(ValueError, match="unknown adapter parameter") as err:
        adapters.adapter_to_peft(name, torch.zeros(2, 2), arch)
    assert name in str(err.value)


def test_a_moe_models_mlp_has_no_adapter():
    arch = arch_from_hf_config(tiny_hf_config("qwen3_moe", layers=2))
    with pytest.raises(ValueError, match="experts"):
        adapters.adapter_to_peft("decoder.layers.0.mlp.linear_fc1.lora.weight_a", torch.zeros(2, 64), arch)
    with pytest.raises(ValueError, match="experts"):
        adapters.peft_shapes(adapters.LoraCard(2, 2.0, ALL), arch)
    assert adapters.peft_target_modules(adapters.LoraCard(2, 2.0, ATTENTION), arch) == [
        "q_proj", "k_proj", "v_proj", "o_proj"]


def test_an_incomplete_adapter_is_refused_and_nothing_is_written(tmp_path):
    arch = arch_from_hf_config(tiny_hf_config("qwen2", layers=2))
    card = adapters.LoraCard(2, 4.0, ATTENTION)
    pairs = peft_pairs(arch, full_adapters(arch, card))
    with pytest.raises(ValueError, match="lacks"):
        adapters.write_peft(tmp_path / "a", card, arch, pairs[1:])
    with pytest.raises(ValueError, match="repeated"):
        adapters.write_peft(tmp_path / "a", card, arch, pairs + pairs[:1])
    with pytest.raises(ValueError, match="shape"):
        adapters.write_peft(tmp_path / "a", card, arch, [(pairs[0][0], torch.zeros(3, 3))] + pairs[1:])
    assert not (tmp_path / "a").exists() and not list(tmp_path.iterdir())


def test_merge_is_computed_in_fp32_and_rounded_once():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
    a, b = (torch.randn(2, 16, generator=gen).to(torch.bfloat16), torch.randn(8, 2, generator=gen).to(torch.bfloat16))
    merged = adapters.merge_shard(weight, a, b, 0.5)
    want = (weight.double() + 0.5 * (b.double() @ a.double())).to(torch.bfloat16)  # exact product, one rounding
    assert merged.dtype == torch.bfloat16 and torch.equal(merged, want)
    assert adapters.merge_shard(weight, a, b, 0.5, torch.float32).dtype == torch.float32


def test_the_model_card_carries_the_adapter_and_old_cards_still_read(tmp_path):
    card = dist_ckpt.DistModelCard({"model_type": "qwen2"}, "float32", {"tp": 2},
                                   adapters.LoraCard(8, 16.0, ATTENTION, 0.05))
    dist_ckpt.write_model_card(tmp_path, card)
    body = json.loads((tmp_path / dist_ckpt.CARD).read_text())
    assert body["lora"] == {"rank": 8, "alpha": 16.0, "targets": ["linear_qkv", "linear_proj"], "dropout": 0.05}
    assert dist_ckpt.read_model_card(tmp_path) == card
    dist_ckpt.write_model_card(tmp_path, dist_ckpt.DistModelCard({"model_type": "qwen2"}, "float32", {}))
    assert "lora" not in json.loads((tmp_path / dist_ckpt.CARD).read_text())  # absent: cards of earlier versions
    assert dist_ckpt.read_model_card(tmp_path).lora is None
    body["lora"] = {"rank": 0, "alpha": 1, "targets": ["linear_qkv"]}
    (tmp_path / dist_ckpt.CARD).write_text(json.dumps(body))
    with pytest.raises(dist_ckpt.CheckpointError, match="rank must be >= 1"):
        dist_ckpt.read_model_card(tmp_path)


def test_the_card_of_a_live_model_from_its_adapter_modules():
    from megatron_offgrpo.model import lora

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
    layer = model.decoder.layers[0]
    layer.self_attention = torch.nn.Module()
    layer.self_attention.linear_proj = torch.nn.Linear(4, 4)
    assert adapters.card_of_model(model) is None
    layer.self_attention.linear_proj.lora = lora.LoraAdapter(torch.zeros(2, 4), torch.zeros(4, 2), 3.0, 0.0, False)
    assert adapters.card_of_model(model) == adapters.LoraCard(2, 3.0, ("linear_proj",))
    layer.self_attention.linear_qkv = torch.nn.Linear(4, 4)
    layer.self_attention.linear_qkv.lora = lora.LoraAdapter(torch.zeros(2, 4), torch.zeros(4, 2), 2.0, 0.0, True)
    with pytest.raises(ValueError, match="several"):
        adapters.card_of_model(model)


def _hf_state(hf_dir) -> dict[str, torch.Tensor]:
    from checkpoint_tools import open_safetensors_dir

    files = open_safetensors_dir(hf_dir)
    return {name: files[name] for name in files.names()}


def _assert_exports(exported: dict[str, dict[str, torch.Tensor]], hf_dir, arch) -> None:
    """The worker's two exports against whole-tensor math on the fixture's adapters (``lora_export_worker``)."""
    from checkpoint_tools._mapping import hf_names
    from tests.workers.lora_export_worker import card_for

    card = card_for(arch)
    fulls = full_adapters(arch, card, seed=1)
    base = _hf_state(hf_dir)
    merged, peft = merged_hf(base, arch, card, fulls), dict(peft_pairs(arch, fulls))
    got_merged, got_peft = exported["merge"], exported["only"]
    assert sorted(got_merged) == sorted(hf_names(arch))  # every HF weight once, and no adapter name leaks in
    assert set(got_peft) == set(peft)
    for name, tensor in got_merged.items():
        # merged per shard in fp32 (a row-parallel shard's product sums over r as the whole one does): within fp32
        # rounding of the fp64 oracle
        assert tensor.dtype == torch.float32 and torch.allclose(tensor, merged[name], rtol=0, atol=2e-6), name
    for name, tensor in got_peft.items():
        assert torch.equal(tensor, peft[name]), name  # gathers move bits: the adapter arrives exactly
    changed = {n.removeprefix("base_model.model.") for n in got_merged if not torch.equal(got_merged[n], base[n])}
    assert changed == {n.removeprefix("base_model.model.").replace(".lora_A", "") for n in peft if ".lora_A." in n}


@pytest.mark.parametrize("variant", ["qwen2_tied", "qwen3_untied", "qwen3_moe"])
def test_a_live_lora_model_streams_merged_and_adapter_only(hf_models, moe_models, variant, tmp_path):
    """One process, TP1: the trainer's export of a model with adapters, both ways; a full export never drops the
    adapter nor leaks its factors; the PEFT adapter on the HF base scores the probe as the megatron model with its
    adapters does; an adapter export of a model without adapters is refused."""
    from checkpoint_tools._mapping import hf_names
    from megatron_offgrpo.model import expose_hidden_states
    from megatron_offgrpo.runtime import destroy_parallel, init_parallel
    from megatron_offgrpo.train._trainer_side import probe_logprobs
    from megatron_offgrpo.train._weights import export_buckets
    from tests.workers.lora_export_worker import PROBE, card_for, export_both, lora_stage

    hf_dir = {**hf_models, **moe_models}[variant]
    ctx = init_parallel(1, 1, 1234, backend="gloo")
    try:
        stage, arch = lora_stage(hf_dir, ctx)
        exported = export_both(stage, arch, ctx)
        assert list(exported["merge"]) == hf_names(arch)  # in the order the streaming writer declares
        _assert_exports(exported, hf_dir, arch)
        trainer_logp = torch.tensor(probe_logprobs(expose_hidden_states(stage), ctx, PROBE), dtype=torch.float64)
        adapter = adapters.write_peft(tmp_path / "peft", card_for(arch), arch, exported["only"].items())
        assert (_peft_logp(hf_dir, adapter, PROBE) - trainer_logp).abs().max() < 1e-5  # megatron's LoRA == PEFT's
        bare = dist_ckpt.cpu_stage(arch, torch.float32)
        with pytest.raises(ValueError, match="no LoRA adapters"):
            next(export_buckets(bare, arch, ctx, adapter="only"))
    finally:
        destroy_parallel()


def _peft_logp(hf_dir, adapter_dir, probe: list[int]) -> torch.Tensor:
    """log p(probe[t] | probe[:t]), t >= 1, of the HF base with the PEFT adapter, in fp32."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    logp = _log_probs(model, torch.tensor([probe]))[0, :-1]
    return logp.gather(-1, torch.tensor(probe[1:]).unsqueeze(-1)).squeeze(-1)


def _convert(*args: str):
    import os
    import subprocess
    import sys

    from tests.helpers import REPO

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", "convert", "megatron-to-hf", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.multiproc
def test_a_lora_model_at_tp2_pp2_exports_what_one_process_computes(hf_models, tmp_path):
    """TP2 x PP2 (gloo): A of row-parallel and B of column-parallel layers gathered over TP (fc1's B by gate/up
    halves), stages sending to rank 0, merged shard by shard before the gather; the PEFT directory of that adapter
    scores the probe on the HF base as the trainer's megatron model does; ``offgrpo convert`` exports the TP2/PP2 dist
    checkpoint of the same model, merged and adapter only, to the same tensors."""
    import shutil

    from safetensors.torch import load_file

    from megatron_offgrpo.model import load_arch
    from tests.helpers import REPO, run_torchrun
    from tests.workers.lora_export_worker import card_for

    hf_dir = hf_models["qwen2_untied"]
    arch = load_arch(hf_dir)
    run_torchrun(REPO / "tests" / "workers" / "lora_export_worker.py", 4, [str(hf_dir), str(tmp_path), "2", "2"])
    exported = {mode: load_file(tmp_path / f"{mode}.safetensors") for mode in ("merge", "only")}
    _assert_exports(exported, hf_dir, arch)
    adapter = adapters.write_peft(tmp_path / "peft", card_for(arch), arch, exported["only"].items())
    trainer = json.loads((tmp_path / "probe.json").read_text())
    peft_logp = _peft_logp(hf_dir, adapter, trainer["probe"])
    assert (peft_logp - torch.tensor(trainer["logp"])).abs().max() < 1e-5

    ckpt = tmp_path / "ckpt"
    assert dist_ckpt.read_model_card(ckpt).lora == card_for(arch)
    for what, out in (("adapter", tmp_path / "convert-adapter"), ("merged", tmp_path / "convert-merged")):
        proc = _convert("--ckpt", str(ckpt), "--out", str(out), "--what", what, "--base-model", str(hf_dir))
        assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(tmp_path / "convert-adapter" / "adapter_model.safetensors")
    assert got.keys() == exported["only"].keys() and all(torch.equal(got[k], exported["only"][k]) for k in got)
    config = json.loads((tmp_path / "convert-adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir) and config["r"] == 4
    merged = _hf_state(tmp_path / "convert-merged")
    assert merged.keys() == exported["merge"].keys()
    assert all(torch.allclose(merged[k], exported["merge"][k], rtol=0, atol=1e-6) for k in merged)
    assert (_peft_logp(hf_dir, tmp_path / "convert-adapter", trainer["probe"]) - peft_logp).abs().max() == 0

    bare = tmp_path / "no-lora"  # the same checkpoint, its card without the adapter: nothing to export as one
    shutil.copytree(ckpt, bare)
    body = json.loads((bare / dist_ckpt.CARD).read_text())
    del body["lora"]
    (bare / dist_ckpt.CARD).write_text(json.dumps(body))
    proc = _convert("--ckpt", str(bare), "--out", str(tmp_path / "x"), "--what", "adapter")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no LoRA adapter" in proc.stderr, proc.stderr
    assert not (tmp_path / "x").exists()
