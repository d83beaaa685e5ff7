"""What crosses the wall, collectively: rank 0's samples to every rank, and the trainer's weights into the engine
(export as buckets, install, verify on a probe). Every function here is called by every rank; ``rollout`` is the
rollout side on global rank 0 and None elsewhere."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

import torch.distributed as dist

from megatron_offgrpo.config import Config
from megatron_offgrpo.data import Sample
from megatron_offgrpo.envs import EnvironmentContractError, EnvironmentTimeout
from megatron_offgrpo.rollout import RefreshReport, errors, probes
from megatron_offgrpo.sampler import RolloutSide
from megatron_offgrpo.train._trainer_side import TrainerSide
from megatron_offgrpo.transports import adapters, deltas

logger = logging.getLogger(__name__)
# what ends a generation on rank 0 and is raised on every rank at the same point (one line each; a stop pending then
# still checkpoints: ``loop``)
GENERATION_FAILURES = (errors.EngineDiedError, EnvironmentTimeout, EnvironmentContractError)


def share_samples(samples: list[Sample] | Exception | None) -> list[Sample]:
    """Rank 0's samples on every rank (every rank needs them: all stages build the same micro-batches). Rank 0 sends
    one of ``GENERATION_FAILURES`` instead when generating them failed so (a dead engine, a stuck or broken
    environment): every rank raises it (they wait here)."""
    box = [samples]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], GENERATION_FAILURES):
        raise box[0]
    return box[0]


@dataclasses.dataclass(frozen=True)
class StepRefresh:
    """Where a step installs the trainer's weights in the engine (``refresh``). Every rank takes part, so every rank
    decides it, from the config alone (``step_refresh``).

    Attributes:
        before_batch: v steps have passed since the served version, and the step's batch is taken after the refresh
            (lockstep: generated from the new version; async: the generator may run up to the new bound).
        after_batch: v steps have passed, with overlap: the step's batch was generated during the previous step,
            from the old version; the refresh comes once it is collected, before the next batch starts.
        before_eval: the last step, evaluated: the trained policy itself is evaluated, not the engine's last version.
    """

    before_batch: bool
    after_batch: bool
    before_eval: bool


def step_refresh(config: Config, step: int, version: int) -> StepRefresh:
    """The one decision of which refreshes step ``step`` makes, the engine serving ``version``. (A resumed run also
    refreshes once before its first step, whatever the step: the engine starts from the exported initial weights.)"""
    due = step - version >= config.rollout.refresh_every
    overlap = config.rollout.mode == "overlap"  # the one mode whose batch is generated before its step's refresh
    return StepRefresh(due and not overlap, due and overlap,
                       step + 1 == config.train.steps and bool(config.train.eval_every))


def refresh(trainer: TrainerSide, rollout: RolloutSide | None, version: int) -> float:
    """Install the trainer's current weights in the engine as ``version`` and verify them; returns the seconds."""
    start = time.perf_counter()
    payload = trainer.refresh_payload(version)
    buckets = payload.buckets if isinstance(payload, (adapters.AdapterPayload, deltas.DeltaPayload)) else payload
    done: list[RefreshReport] = []

    def install() -> None:
        try:
            report = rollout.install(payload, version)
            if report is not None:  # a detail: its time is in the progress line (runlog._logs keeps it off the console)
                done.append(report)
                logger.info("refresh to version %d: %.3f s, %s, %.1f MB (%s)%s", version, report.seconds, report.kind,
                            report.bytes / 1e6, report.transport, delta_note(report))
        finally:
            for _ in buckets:  # the export is collective: finish it even when the install stopped early
                pass

    if rollout is None:
        for _ in buckets:
            pass
    on_rank0_shared(rollout, install, f"refresh to version {version} failed")
    verify(trainer, rollout, version)
    report = done[0] if done else None
    trainer.weights_pushed(version, report.full_sync if report else None, bool(report and report.kind == "delta"))
    if report is not None and isinstance(payload, deltas.DeltaPayload):
        trainer.refresh_metrics = refresh_metrics(report, trainer.delta.full_syncs if trainer.delta else {})
    return time.perf_counter() - start


def delta_note(report: RefreshReport) -> str:
    """The refresh log line's delta part: changed fraction, encode seconds, engines that got a full sync and why."""
    if "changed_fraction" not in report.detail:
        return ""
    note = f", {100 * report.detail['changed_fraction']:.2f}% changed, encoded in {report.detail['encode_s']:.3f} s"
    if report.full_sync:
        note += ", full sync for " + "; ".join(f"{n}: {why}" for n, why in report.full_sync.items())
    return note


def refresh_metrics(report: RefreshReport, full_syncs: dict[str, int]) -> dict[str, float]:
    """A delta-mode refresh's figures for metrics.jsonl (the step's record: ``sync_*``)."""
    return {"sync_bytes": float(report.bytes), "sync_changed_fraction": report.detail.get("changed_fraction", 1.0),
            "sync_encode_s": report.detail.get("encode_s", 0.0), "sync_delta": float(report.kind == "delta"),
            "sync_full_syncs": float(sum(full_syncs.values()))}


def verify(trainer: TrainerSide, rollout: RolloutSide | None, version: int) -> None:
    """Check the engine scores the probe like the trainer's current weights (raises on every rank).

    Raises:
        RefreshVerificationError (rank 0) / RuntimeError (other ranks): the engine does not serve these weights.
    """
    probe = probes.make_probe_ids(trainer.arch.vocab_size)
    expected = trainer.probe_logprobs(probe)
    bound = trainer.probe_bound()
    on_rank0_shared(rollout, lambda: rollout.verify(probe, expected, version, bound),
                     f"engine at version {version} failed verification")


def on_rank0_shared(rollout: RolloutSide | None, action: Callable[[], None], failure: str) -> None:
    """Run ``action`` on rank 0 and share its outcome: rank 0 re-raises its own error, the other ranks raise
    ``RuntimeError(failure + reason)`` (a dead engine: the same ``EngineDiedError``, whose one line every rank
    prints); without this they would hang in the next collective."""
    status = [None]
    if rollout is not None:
        try:
            action()
        except Exception as exc:
            status = [exc if isinstance(exc, errors.EngineDiedError) else f"{type(exc).__name__}: {exc}"]
            raise
        finally:
            dist.broadcast_object_list(status, src=0)
        return
    dist.broadcast_object_list(status, src=0)
    if isinstance(status[0], errors.EngineDiedError):
        raise status[0]
    if status[0] is not None:
        raise RuntimeError(f"{failure} on rank 0: {status[0]}")
