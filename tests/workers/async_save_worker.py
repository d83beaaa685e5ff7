"""torchrun worker: checkpoints written in the background (``train.async_save``) hold the state of the step they were
started at. One optimizer step, then two saves, each followed at once by a change of every parameter and every
optimizer state tensor in place (+1) while the writer sleeps (``OFFGRPO_TEST_SAVE_DELAY_S``) before it writes;
each checkpoint, loaded back, must be bit-identical to the state at its own save (not the change after it, not the
first save again). The same state after a load is the exact-resume check.

argv: HF_DIR, RUN_DIR, then config overrides (parallel.tp=2, optim.distributed_optimizer=true, lora.rank=4, ...).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.runtime import BackgroundSave
from megatron_offgrpo.train._trainer_side import TrainerSide
from tests.workers.sp_step_worker import G, fixed_samples

DELAY_S = 1.5


def _tensors(side) -> list[torch.Tensor]:
    """Every parameter of this rank's stage (by name) and every tensor of its optimizers' state (by group order)."""
    out = [p for _, p in sorted(side.policy.model.named_parameters())]
    for opt in getattr(side.policy.optimizer, "chained_optimizers", [side.policy.optimizer]):
        for group in opt.optimizer.param_groups:
            for param in group["params"]:
                state = opt.optimizer.state.get(param, {})
                out += [state[k] for k in sorted(state) if torch.is_tensor(state[k]) and state[k].numel() > 1]
    return out


@torch.no_grad()
def _change_everything(side) -> None:
    for tensor in _tensors(side):
        tensor.add_(1.0)


def _snapshot(side) -> list[torch.Tensor]:
    return [t.detach().clone() for t in _tensors(side)]


def _same(side, want: list[torch.Tensor], what: str) -> None:
    got = _tensors(side)
    assert len(got) == len(want) and len(got) > 0, (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{what}: tensor {i} {tuple(g.shape)} differs by {(g - w).abs().max().item()}"


def main() -> None:
    hf_dir, run_dir, *overrides = sys.argv[1:]
    os.environ["OFFGRPO_TEST_SAVE_DELAY_S"] = str(DELAY_S)  # read by the forked writer
    config = load_config(None, [f"model.hf_path={hf_dir}", "model.init=hf", "rollout.engine=transformers",
                                f"rollout.group_size={G}", "rollout.prompts_per_step=2", "optim.lr=1e-3",
                                "train.deterministic=true", "train.async_save=true", f"train.out_dir={run_dir}",
                                *overrides])
    side = TrainerSide.build(config)
    assert isinstance(side.background, BackgroundSave)
    samples = fixed_samples(side.arch.vocab_size, side.arch.num_layers, 0, 0)
    side.learn(samples)
    saved, checkpoints = {}, Path(run_dir) / "checkpoints"
    for step in (1, 2):
        saved[step] = _snapshot(side)
        start = time.perf_counter()
        side.save(step, 0)  # step 2's save finishes step 1's first
        blocked = time.perf_counter() - start
        assert side.background.what is not None, "nothing written in the background"
        assert step == 2 or blocked < DELAY_S, f"the save blocked the step {blocked:.2f} s"
        # visible only when complete: the one in flight is a temporary directory, the one finished is published
        assert (checkpoints / f"step_{step:08d}.tmp").is_dir() and not (checkpoints / f"step_{step:08d}").exists()
        assert step == 1 or (checkpoints / "step_00000001" / "trainer_state.json").exists()
        _change_everything(side)
    changed = _snapshot(side)
    side.saved("the test's end")
    assert side.background.what is None
    _same(side, changed, "the state after the saves")  # finishing a save changes nothing in the trainer
    for step in (1, 2):
        side.restore(f"{run_dir}/checkpoints/step_{step:08d}")
        _same(side, saved[step], f"checkpoint of step {step}")
    loss = side.learn(samples).metrics["loss"]
    print(f"EXACT tp={side.ctx.tp_size} pp={side.ctx.pp_size} dp={side.ctx.dp_size} loss={loss:.6f}")


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)
