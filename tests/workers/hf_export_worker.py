"""torchrun worker: a short real `offgrpo train` run (the driver itself, so RUN/hf and RUN/exports are its own),
then the trainer's log-probs of a probe under the weights of the run's final checkpoint, loaded back into a fresh
stage of the same layout; rank 0 writes them to OUT/trainer_probe.json for the test to hold the HF exports against.

Only the checkpoint's model part is loaded (as the export does): restoring a distributed optimizer into a fresh
one trips megatron's ``assert len(steps) == 1`` on CPU (no apex/TE), which is a resume matter, not an export one.

Usage: torchrun --nproc_per_node N hf_export_worker.py OUT_DIR [key=value ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from checkpoint_tools import dist_ckpt
from megatron_offgrpo.config import load_config
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.runtime import init_parallel
from megatron_offgrpo.runlog._checkpoints import latest_checkpoint
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._trainer_side import probe_logprobs
from megatron_offgrpo.train.loop import train
from tests.train.conftest import TINY

PROBE = [9707, 11, 1879, 0, 279, 4226, 374, 220, 19, 13, 151643, 17, 10, 18, 28, 20, 3555, 2160]


def main() -> None:
    out = Path(sys.argv[1])
    config = load_config(None, TINY + [f"train.out_dir={out}", *sys.argv[2:]])
    train(config)
    from megatron.core import dist_checkpointing  # after the run set megatron up (TE detection first)

    ctx = init_parallel(config.parallel.tp, config.parallel.pp, config.parallel.seed)  # the run's (already set up)
    policy = build_policy(load_arch(config.model.hf_path), ctx, config.model, config.optim, config.train.steps)
    ckpt = latest_checkpoint(out)
    loaded = dist_checkpointing.load({dist_ckpt.DIST_MODEL_KEY: policy.model.sharded_state_dict()}, str(ckpt))
    policy.model.load_state_dict(loaded[dist_ckpt.DIST_MODEL_KEY])
    logp = probe_logprobs(policy.model, ctx, PROBE)
    if ctx.rank == 0:
        (out / "trainer_probe.json").write_text(json.dumps({"checkpoint": str(ckpt), "probe": PROBE, "logp": logp}))
        print("PROBE WRITTEN")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
