"""Training checkpoints: megatron distributed checkpoint of model + optimizer, plus everything a resume needs.

Layout of ``RUN/checkpoints/step_00000040/``: megatron ``dist_checkpointing`` files (model and optimizer, sharded by
every rank), ``rng_rank{r}.pt`` (CPU and model-parallel RNG states of each rank), ``offgrpo_model.json`` and
``hf_extra/`` (the model's HF config, dtype, tokenizer and generation config: ``checkpoint_tools``' card, so ``offgrpo
convert megatron-to-hf`` exports the checkpoint without the recipe), ``rollout_state.pt`` (rank 0's ``RolloutState``:
the prompt stream's position and the batches generated but not yet trained), ``log_tail.json`` (the metrics records and
completion rows since the previous checkpoint, fsynced in the run's files first: ``runlog.checkpoints``) and
``trainer_state.json`` (step, engine version, scheduler) written last. A step is written into ``step_X.tmp`` and renamed
by rank 0 after every rank finished, so a crash (even ``kill -9``) never leaves a directory that looks complete. With
``train.async_save`` the tensors are written in the background (``runtime.BackgroundSave``), renamed once finalized.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from checkpoint_tools import dist_ckpt, files
from megatron_offgrpo.runlog import checkpoints, writing
from megatron_offgrpo.runtime import BackgroundSave

logger = logging.getLogger(__name__)
ROLLOUT_STATE = "rollout_state.pt"
# dp_reshardable: fully parallel save/load, reshardable over DP (the layout TP/PP stays as trained).
OPTIM_META = {"distrib_optim_sharding_type": "dp_reshardable"}


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def sweep_partial_exports(run_dir: str | Path) -> list[Path]:
    """Remove the temporary directories a killed HF export left (``exports/.step_N.tmp-PID-...``, ``.hf.tmp-...``:
    ``checkpoint_tools.files.atomic_output_dir``'s, of a process no longer running), saying so; returns them. A resume
    writes the interrupted export again (``train.loop``). Only the run's rank 0 calls it, before any export."""
    run_dir = Path(run_dir)
    finals = {run_dir / "hf"} | {tmp.parent / tmp.name[1:].split(".tmp-")[0]
                                 for tmp in (run_dir / "exports").glob(".step_*.tmp-*")}
    swept = [path for final in sorted(finals) for path in files.sweep_stale_siblings(final)]
    for path in swept:
        logger.warning("removed %s, left by an HF export that was interrupted", path)
    return swept


def _rng_state() -> dict[str, Any]:
    """This process's generators: torch's, the CUDA device's and megatron's model-parallel ones."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))  # a copy: the tracker replaces entries as it forks
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sharded(model, optimizer, is_loading: bool) -> dict[str, Any]:
    model_sd = model.sharded_state_dict()
    return {
        dist_ckpt.DIST_MODEL_KEY: model_sd,  # the part checkpoint_tools' HF export reads back
        "optimizer": optimizer.sharded_state_dict(model.sharded_state_dict(), is_loading=is_loading,
                                                  metadata=OPTIM_META),
    }


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What ``trainer_state.json`` holds, written last (its presence marks a complete checkpoint).

    Attributes:
        step: optimizer steps done. version: the weight version the engine served at the checkpoint.
        scheduler: megatron's learning-rate scheduler state (its own ``state_dict``).
        config: the run's config as a nested dict (None: a checkpoint from before it was kept).
        stream: the prompt stream's position, kept by checkpoints from before ``rollout_state.pt`` (None since).
    """

    step: int
    version: int
    scheduler: dict[str, Any]
    config: dict[str, Any] | None = None
    stream: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in dataclasses.asdict(self).items() if v is not None}, indent=1)

    @classmethod
    def read(cls, path: Path) -> TrainerState:
        """The state of checkpoint ``path`` (``path/trainer_state.json``), naming the file and field when it is not
        one (a key this version does not know is ignored: a newer writer's)."""
        file = path / checkpoints.STATE
        data = json.loads(file.read_text())
        try:
            return cls(step=int(data["step"]), version=int(data.get("version", 0)), scheduler=dict(data["scheduler"]),
                       config=data.get("config"), stream=data.get("stream"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{file}: not a trainer state ({type(exc).__name__}: {exc}): resume from another "
                             "checkpoint (remove this step_N)") from None


def save_checkpoint(run_dir: str | Path, model, optimizer, trainer_state: TrainerState, keep: int = 2, *,
                    card: dist_ckpt.DistModelCard, extra_dirs: Sequence[Path] = (), rollout_state: Any = None,
                    log_tail: dict[str, list] | None = None, background: BackgroundSave | None = None) -> Path:
    """Save the checkpoint of ``trainer_state.step`` (collective: every rank calls it). Keeps the newest ``keep``.

    Args:
        card: the model's description (``_weights.model_card``). extra_dirs: tokenizer / generation config sources.
        rollout_state: rank 0's rollout side (``RolloutState``: untrained batches hold tensors and many tokens, so a
            binary file, ``rollout_state.pt``, beside the JSON state).
        log_tail: rank 0's records and completion rows since the previous checkpoint, already durable in the run's
            files (``MetricsLog.checkpoint_tail``): ``log_tail.json``, what a resume restores a lost one from.
        background: ``train.async_save``: this returns once a forked process writes the tensors (the other files
            are written now) and the rename comes when ``background`` finalizes it (at the latest before a save).
    """
    from megatron.core import dist_checkpointing

    from megatron_offgrpo.runtime import use_in_process_save_queue

    root = Path(run_dir) / "checkpoints"
    final = _step_dir(root, trainer_state.step)
    tmp = final.with_name(final.name + ".tmp")
    if background is not None:  # the save in flight: before this one's tmp (its commit prunes the old steps)
        background.finish("before the next save")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    sharded = _sharded(model, optimizer, is_loading=False)
    with writing(tmp):  # a full disk leaves step_N.tmp, named in the error: never a complete-looking step
        if background is None:
            use_in_process_save_queue()  # megatron's own spawns a server that imports torch: 3 s on the first save
            dist_checkpointing.save(sharded, str(tmp))
        else:
            request = background.prepare(sharded, tmp)
        torch.save(_rng_state(), tmp / f"rng_rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        with writing(tmp):
            dist_ckpt.write_model_card(tmp, card, extra_dirs)
            if rollout_state is not None:
                torch.save(rollout_state, tmp / ROLLOUT_STATE)
            if log_tail is not None:
                (tmp / checkpoints.TAIL_FILE).write_text(json.dumps(log_tail, default=float))
    commit = functools.partial(_publish, tmp, final, trainer_state.to_json(), keep)
    if background is None:
        commit()
    else:
        background.start(request, f"checkpoint {final}", commit, model, optimizer)
    return final


def _publish(tmp: Path, final: Path, state_json: str, keep: int) -> None:
    """The commit of a checkpoint whose files are all written: rank 0 writes ``trainer_state.json`` into ``tmp``,
    renames it ``final`` and keeps the newest ``keep``. Collective."""
    dist.barrier()  # every rank's files are written
    if dist.get_rank() == 0:
        with writing(tmp):
            (tmp / checkpoints.STATE).write_text(state_json)
            fd = os.open(tmp, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in sorted(p for p in final.parent.glob("step_*") if not p.name.endswith(".tmp"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
    dist.barrier()


def load_checkpoint(path: str | Path, model, optimizer) -> TrainerState:
    """Restore model, optimizer and this rank's RNG states from ``path``; returns the trainer state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = TrainerState.read(path)
    loaded = dist_checkpointing.load(_sharded(model, optimizer, is_loading=True), str(path))
    model.load_state_dict(loaded[dist_ckpt.DIST_MODEL_KEY])
    with torch.no_grad():  # fp32 params are their own main params: the optimizer copies into views of leaves
        optimizer.load_state_dict(loaded["optimizer"])
    rng_file = path / f"rng_rank{dist.get_rank()}.pt"
    if not rng_file.exists():
        raise ValueError(f"{rng_file} missing: resume with the same number of processes and layout as the run")
    _set_rng_state(torch.load(rng_file, weights_only=False))
    logger.info("resumed from %s (step %d)", path, state.step)
    return state


SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")


def resume_schedule(scheduler, saved: dict[str, Any]) -> None:
    """Continue the learning-rate schedule at the checkpoint's step. When the recipe's schedule differs from the
    checkpoint's (say train.steps was raised to extend a finished run, whose saved schedule has already decayed),
    the recipe's schedule is re-planned from that step, saying so: never the silent zero learning rate of megatron's
    checkpoint-wins default."""
    now = scheduler.state_dict()
    changed = [f"{k} {saved.get(k)} -> {now[k]}" for k in SCHEDULE_KEYS if saved.get(k) != now[k]]
    if not changed:
        scheduler.load_state_dict(saved)
        return
    scheduler.step(increment=saved["num_steps"])
    logger.warning("resume: the learning-rate schedule differs from the checkpoint's (%s): re-planned from step %d "
                   "with the recipe's values (lr now %.3g)", ", ".join(changed), saved["num_steps"],
                   scheduler.optimizer.param_groups[0]["lr"])


def load_rollout_state(path: str | Path, trainer_state: TrainerState):
    """The rollout side's ``RolloutState`` of checkpoint ``path`` (rank 0). A checkpoint written before it had one
    keeps only the prompt stream's position in its JSON state."""
    from megatron_offgrpo.sampler import RolloutState

    file = Path(path) / ROLLOUT_STATE
    if file.exists():
        return torch.load(file, weights_only=False)  # our own file: batches of samples, not just tensors
    return RolloutState(trainer_state.stream)
