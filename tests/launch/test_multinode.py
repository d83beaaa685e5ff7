"""The multi-node launch path for real on one machine: two `launch/multinode.sh` agents (NODE_RANK 0 and 1,
c10d rendezvous on 127.0.0.1) train the tiny model to the same losses as one `--nproc_per_node=2` run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, _free_port
from tests.train.conftest import TINY, metrics, run_train, train_env

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_two_nodes_match_one_node(tmp_path):
    overrides = [*TINY, "parallel.tp=2", "train.steps=3", "rollout.refresh_every=1"]
    single = run_train(2, tmp_path / "single", "parallel.tp=2", "train.steps=3", "rollout.refresh_every=1")
    env = dict(train_env(), NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RDZV_ID="test",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = tmp_path / "multi"
    agents = [
        subprocess.Popen(["bash", str(REPO / "launch" / "multinode.sh"), "1", "none", *overrides,
                          f"train.out_dir={out}"], cwd=REPO, env=dict(env, NODE_RANK=str(rank)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]
    logs = [agent.communicate(timeout=600)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), "\n".join(log[-4000:] for log in logs)
    multi = metrics(out)
    assert [r["loss"] for r in multi] == [r["loss"] for r in single]
    assert [r["reward_mean"] for r in multi] == [r["reward_mean"] for r in single]
