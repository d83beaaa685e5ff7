"""The launch scripts without a cluster: shell syntax, and the Slurm batch file's node split, fleet commands, server
URLs and trainer command read from its DRY_RUN=1 output: inside a (faked) allocation, with Slurm's `scontrol`
replaced by a stub that expands the node list, and outside any allocation with the nodes named in NODES."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_offgrpo.fleet import launcher
from megatron_offgrpo.cli.fleet import build_parser
from tests.helpers import REPO

SBATCH = REPO / "launch" / "slurm.sbatch"
RECIPE = REPO / "configs" / "qwen2.5-7b-gsm8k-fp8.yaml"
NODES = [f"gpu{i:02d}" for i in range(1, 5)]
# `scontrol show hostnames gpu[01-04]` prints one host per line; the stub refuses any other call.
SCONTROL = f"""#!/usr/bin/env bash
[ "$1 $2 $3" = "show hostnames gpu[01-04]" ] || {{ echo "unexpected scontrol call: $*" >&2; exit 1; }}
printf '%s\\n' {' '.join(NODES)}
"""


@pytest.mark.parametrize("script", ["torchrun.sh", "multinode.sh", "fleet.sh", "slurm.sbatch"])
def test_launch_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(REPO / "launch" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def dry_run(tmp_path: Path, *overrides: str, allocation: bool = True, **env: str) -> subprocess.CompletedProcess:
    """DRY_RUN=1 of the batch file; ``allocation``: inside a faked Slurm job (scontrol stub, SLURM_* set), else with
    no Slurm variable and no scontrol at all."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONPATH=str(REPO), PYTHON=sys.executable,
                DRY_RUN="1", SHARED_DIR=str(tmp_path / "shared"))
    if allocation:
        (stub / "scontrol").write_text(SCONTROL)
        (stub / "scontrol").chmod(0o755)
        base.update(PATH=f"{stub}:{base['PATH']}", SLURM_JOB_NODELIST="gpu[01-04]", SLURM_JOB_ID="77")
    full = dict(base, **env)
    return subprocess.run(["bash", str(SBATCH), str(RECIPE), *overrides], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=120)


def fleet_starts(stdout: str) -> list:
    """The parsed `offgrpo fleet start` of each fleet step (the real CLI parser: every flag must exist)."""
    out = []
    for line in stdout.splitlines():
        step = shlex.split(line) if line.startswith("srun") else []
        if "bash" in step:
            start = shlex.split(step[-1].split("&&")[0])
            assert start[:3] == ["offgrpo", "fleet", "start"], start
            out.append(build_parser().parse_args(start[2:]))
    return out


def test_two_fleet_nodes_of_four(tmp_path):
    proc = dry_run(tmp_path, "optim.lr=2e-6", FLEET_NODES="2", GPUS_PER_NODE="4", FLEET_TP="2", FLEET_PORT="9000")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    shared = tmp_path / "shared"
    assert "fleet nodes: gpu01 gpu02" in lines and "trainer nodes: gpu03 gpu04" in lines
    # 4 GPUs / TP 2 = 2 servers per fleet node, on ports 9000 and 9001 of each
    urls = ["http://gpu01:9000", "http://gpu01:9001", "http://gpu02:9000", "http://gpu02:9001"]
    assert f"fleet servers: {' '.join(urls)}" in lines
    steps = [shlex.split(line) for line in lines if line.startswith(("srun", "offgrpo"))]

    fleets = [s for s in steps if "bash" in s]
    assert [s[s.index("-w") + 1] for s in fleets] == ["gpu01", "gpu02"]
    recorded = []
    for i, args in enumerate(fleet_starts(proc.stdout)):
        assert (args.model, args.num_servers, args.tp, args.host) == (
            Path("models/Qwen2.5-7B-Instruct"), 2, 2, f"gpu0{i + 1}")
        assert args.max_model_len == 512 + 1024  # the recipe's max_prompt_tokens + max_new_tokens, not 32768
        assert args.state_dir == shared / f"fleet-{i}"
        recorded += [launcher.server_url(args.host, args.base_port + k) for k in range(args.num_servers)]
    assert recorded == urls  # the URLs the script announces are the ones `fleet start` records

    (merge,) = [s for s in steps if s[:3] == ["offgrpo", "fleet", "merge"]]
    assert merge[3:] == ["--state-dir", str(shared / "fleet"), str(shared / "fleet-0"), str(shared / "fleet-1")]

    (trainer,) = [s for s in steps if "torchrun" in s]
    assert trainer[trainer.index("-w") + 1] == "gpu03,gpu04" and "--nodes=2" in trainer
    torchrun = trainer[trainer.index("torchrun"):]
    assert torchrun[torchrun.index("--nnodes") + 1] == "2" and torchrun[torchrun.index("--nproc_per_node") + 1] == "4"
    assert torchrun[torchrun.index("--rdzv_endpoint") + 1] == "gpu03:29500"
    assert torchrun[torchrun.index("--rdzv_id") + 1] == "77"
    tail = torchrun[torchrun.index("--config"):]
    assert tail == ["--config", str(RECIPE), "optim.lr=2e-6", "rollout.engine=fleet",
                    f"rollout.fleet_state={shared / 'fleet'}"]

    stops = [s for s in steps if s[-3:-1] == ["stop", "--state-dir"]]
    assert [(s[s.index("-w") + 1], s[-1]) for s in stops] == [("gpu01", str(shared / "fleet-0")),
                                                                ("gpu02", str(shared / "fleet-1"))]
    assert os.environ.get("OFFGRPO_FLEET_TOKEN", "\0") not in proc.stdout


def test_overrides_reach_the_fleet_model(tmp_path):
    proc = dry_run(tmp_path, "model.hf_path=/models/other", FLEET_NODES="1")
    assert proc.returncode == 0, proc.stderr
    assert [args.model for args in fleet_starts(proc.stdout)] == [Path("/models/other")]
    assert "trainer nodes: gpu02 gpu03 gpu04" in proc.stdout


def test_dry_run_needs_no_allocation_with_nodes_named(tmp_path):
    proc = dry_run(tmp_path, allocation=False, NODES="n0 n1 n2", GPUS_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    assert "fleet nodes: n0" in proc.stdout and "trainer nodes: n1 n2" in proc.stdout
    assert "fleet servers: http://n0:8100 http://n0:8101" in proc.stdout
    assert [args.host for args in fleet_starts(proc.stdout)] == ["n0"]
    assert "--rdzv_id dry-run" in proc.stdout and str(tmp_path / "shared" / "fleet") in proc.stdout


def test_no_allocation_and_no_nodes_says_how_to_dry_run(tmp_path):
    proc = dry_run(tmp_path, allocation=False)
    assert proc.returncode == 2 and "no Slurm allocation" in proc.stderr and 'NODES="n0 n1" DRY_RUN=1' in proc.stderr


@pytest.mark.parametrize("env, message", [
    ({"FLEET_NODES": "4"}, "FLEET_NODES=4 of 4 nodes leaves none to train"),
    ({"FLEET_NODES": "0"}, "FLEET_NODES=0: expected a whole number >= 1"),
    ({"GPUS_PER_NODE": "8", "FLEET_TP": "3"}, "FLEET_TP=3 does not divide GPUS_PER_NODE=8"),
])
def test_bad_layouts_are_refused(tmp_path, env, message):
    proc = dry_run(tmp_path, **env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
