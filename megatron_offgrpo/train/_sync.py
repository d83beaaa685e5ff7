"""The engine refresh: export the trainer's weights as version k, install them, verify them on a probe."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from megatron_offgrpo.train._batch import MicroBatch
from megatron_offgrpo.train._policy import copy_weights
from megatron_offgrpo.train._step import token_logprobs
from megatron_offgrpo.train._weights import export_buckets

logger = logging.getLogger(__name__)


def probe_logprobs(run, probe_ids: list[int]) -> list[float]:
    """The trainer's log p(probe[t] | probe[:t]), t >= 1, on every rank (collective).

    At temperature 1 whatever the sampling temperature: engines score a given sequence (vLLM's prompt log-probs)
    with the raw distribution, and the probe checks the weights, not the sampler.
    """
    ids = torch.tensor(probe_ids[:-1]).unsqueeze(0)
    zeros = torch.zeros_like(ids, dtype=torch.float32)
    mb = MicroBatch(ids, torch.arange(ids.shape[1]).unsqueeze(0), torch.tensor(probe_ids[1:]).unsqueeze(0),
                    torch.ones_like(ids, dtype=torch.bool), zeros, zeros, zeros,
                    torch.zeros_like(ids)).to(run.ctx.device)
    out = token_logprobs(run.policy.model, run.ctx, [mb], temperature=1.0)
    logp = (out[0].reshape(-1).double() if out
            else torch.zeros(ids.shape[1], dtype=torch.float64, device=run.ctx.device))
    if run.ctx.tp_rank != 0:
        logp = torch.zeros_like(logp)  # TP ranks hold copies: count one
    dist.all_reduce(logp, group=run.ctx.pp_group)  # only the last stage computed it
    return logp.tolist()


def verify_engine(run, version: int) -> None:
    """Check the engine scores the probe like the trainer's current weights (collective; raises on every rank).

    Raises:
        RefreshVerificationError (rank 0) / RuntimeError (other ranks): the engine does not serve these weights.
    """
    expected = probe_logprobs(run, run.probe_ids)

    def check() -> None:
        from megatron_offgrpo.rollout import verify_refresh
        from megatron_offgrpo.train.builders import verify_tolerance

        atol = verify_tolerance(run.config.rollout, run.config.model.precision)
        verify_refresh(run.engine, run.probe_ids, expected, version, atol)

    _on_rank0_shared(run, check, f"engine at version {version} failed verification")


def refresh_engine(run, version: int) -> float:
    """Install the current weights as ``version`` in the engine (rank 0) and verify them. Collective."""
    start = time.perf_counter()
    buckets = export_buckets(run.policy.model, run.arch, run.ctx, run.config.rollout.bucket_mb * 1024**2)

    def install() -> None:
        try:
            _install(run.engine, buckets, version)
        finally:
            for _ in buckets:  # the export is collective: finish it even when the install stopped early
                pass

    if run.ctx.rank != 0:
        for _ in buckets:
            pass
    _on_rank0_shared(run, install, f"refresh to version {version} failed")
    verify_engine(run, version)
    if run.snapshot is not None:
        copy_weights(run.policy.model, run.snapshot)
    run.version = version
    return time.perf_counter() - start


def _on_rank0_shared(run, action, failure: str) -> None:
    """Run ``action`` on rank 0 and share its outcome (collective): rank 0 re-raises its own error, the other
    ranks raise ``RuntimeError(failure + reason)``; without this they would hang in the next collective."""
    status = [None]
    if run.ctx.rank == 0:
        try:
            action()
        except Exception as exc:
            status = [f"{type(exc).__name__}: {exc}"]
            raise
        finally:
            dist.broadcast_object_list(status, src=0)
        return
    dist.broadcast_object_list(status, src=0)
    if status[0] is not None:
        raise RuntimeError(f"{failure} on rank 0: {status[0]}")


def _install(engine, buckets, version: int) -> None:
    """``engine.update_weights``, tolerating servers that failed when the others installed the version.

    A fleet server that died (or failed to install) since the last refresh leaves the rotation and the run goes
    on with the rest (a later refresh brings it back if it recovers); only a refresh that no server installed
    stops the run.
    """
    from megatron_offgrpo.rollout import RefreshError

    try:
        report = engine.update_weights(buckets, version)
    except RefreshError as exc:
        if engine.version() != version:
            raise
        logger.warning("%s\ntraining goes on with the servers that installed version %d", exc, version)
        return
    logger.info("refresh to version %d: %.3f s (%s)", version, report.seconds, report.transport)
