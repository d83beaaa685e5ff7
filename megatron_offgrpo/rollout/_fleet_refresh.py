"""One weight refresh of a fleet: pause the servers (draining or, with partial rollouts, freezing their requests),
install the version through the transport (a delta a server refuses sent again whole), reset each prefix cache and
label the engine with the version, resume; then what it moved and took (``RefreshReport``) and who failed."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from megatron_offgrpo.rollout._dispatch import ServerPool
from megatron_offgrpo.rollout._server import ServerClient
from megatron_offgrpo.rollout._types import RefreshReport
from megatron_offgrpo.transports import DIRTY, Buckets, WeightTransport, WorkerAnswer, adapters, deltas

logger = logging.getLogger(__name__)

_NO_ANSWER = WorkerAnswer(ok=False)  # a paused server the transport gave no answer for: it installed nothing


@dataclasses.dataclass(frozen=True)
class RefreshOutcome:
    """What a refresh did: its report (``servers``: those that installed the version), the servers that did not and
    why, and whether those left the rotation (some server installed it, or theirs are unsafe to serve)."""

    report: RefreshReport
    failures: dict[str, str]
    benched: bool


@dataclasses.dataclass
class FleetRefresh:
    """One refresh of ``servers`` from version ``current`` through ``transport``; ``pool`` learns its outcome (the
    servers that installed it are back in rotation, the others leave it)."""

    servers: dict[str, ServerClient]
    pool: ServerPool
    transport: WeightTransport
    partial_rollouts: bool
    current: int

    def run(self, weights: Buckets | Path | adapters.AdapterPayload, version: int) -> RefreshOutcome:
        """Install ``version`` on every server not dead (``FleetEngine.update_weights`` checked it is newer, holds
        the refresh lock and runs the health checks); the pool learns who failed."""
        start = time.perf_counter()
        prepared = self.transport.prepare(weights, version)
        staged = time.perf_counter()
        names = [n for n in self.servers if n not in self.pool.dead]
        failures = self._each(names, "pause", lambda server: server.pause(keep_in_flight=self.partial_rollouts))
        paused = [n for n in names if n not in failures]
        installed_at = time.perf_counter()
        try:
            answers = self._install(paused, prepared, version)
            full_sync, sent = self._full_fallback(weights, paused, answers, version)
            for name in paused:
                problem = self._finish(name, answers.get(name, _NO_ANSWER), version)
                if problem:
                    failures[name] = problem
        finally:
            installed = time.perf_counter()
            failures.update(self._each(paused, "resume", ServerClient.resume))
        return self._conclude(
            version,
            names,
            answers,
            failures,
            (weights, full_sync, sent),
            {
                "prepare_s": staged - start,
                "pause_s": installed_at - staged,
                "install_s": installed - installed_at,
                "resume_s": time.perf_counter() - installed,
                "total_s": time.perf_counter() - start,
            },
        )

    def _install(self, names: list[str], prepared: Any, version: int) -> dict[str, WorkerAnswer]:
        """The transport's install on the servers ``names``; a transport failure is every server's failed answer."""
        try:
            return self.transport.install([self.servers[n] for n in names], prepared, version)
        except Exception as exc:
            return {n: WorkerAnswer.failed(f"transport failed: {type(exc).__name__}: {exc}") for n in names}

    def _full_fallback(self, weights: Any, names: list[str], answers: dict[str, WorkerAnswer],
                       version: int) -> tuple[dict[str, deltas.FullSyncReason], int]:
        """After a delta: the servers that did not install it (a restarted or joined server has no image, another
        base, a corrupt blob...) get the same version whole, at once (``answers`` updated). Returns (server -> why it
        got the full version, bytes the delta moved before); ({}, 0) when every server took it, or not a delta."""
        if not isinstance(weights, deltas.DeltaPayload) or weights.spec.base is None:
            return {}, 0
        failed = {n: answers.get(n, _NO_ANSWER) for n in names if not answers.get(n, _NO_ANSWER).ok}
        if not failed:
            return {}, 0
        refused = {n: deltas.refusal(a.full_sync_needed) for n, a in failed.items()}
        sent = self.transport.metrics().bytes
        logger.warning("delta to version %d not installed on %s: sending it whole (%s)", version, sorted(refused),
                       "; ".join(f"{n}: {a.error}" for n, a in failed.items()))
        try:
            prepared = self.transport.prepare(weights.as_full(), version)
        except Exception as exc:
            answers.update({n: WorkerAnswer.failed(f"full sync after a refused delta: {type(exc).__name__}: {exc}")
                            for n in refused})
            return refused, sent
        answers.update(self._install(sorted(refused), prepared, version))
        return refused, sent

    def _each(self, names: list[str], action: str, call: Callable[[ServerClient], None]) -> dict[str, str]:
        """Run a control ``call`` on servers concurrently; returns name -> error for those that failed."""
        errors: dict[str, str] = {}

        def run(name: str) -> None:
            try:
                call(self.servers[name])
            except Exception as exc:
                errors[name] = f"{action} failed: {exc}"

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return errors

    def _finish(self, name: str, answer: WorkerAnswer, version: int) -> str | None:
        """After a worker installed ``version``: reset the prefix cache and label the engine; None when all good."""
        if not answer.ok:
            return answer.error or "rejected"
        server = self.servers[name]
        try:
            if not server.reset_prefix_cache(in_flight=self.partial_rollouts):
                return "installed, but the server kept KV blocks of the previous weights (prefix cache reset refused)"
            server.set_version_label(version)
            label = server.version_label()
        except Exception as exc:
            return f"installed, but resetting its prefix cache or labelling the version failed: {exc}"
        return None if label == str(version) else f"installed, but the engine reports version label {label!r}"

    def _conclude(
        self,
        version: int,
        names: list[str],
        answers: dict[str, WorkerAnswer],
        failures: dict[str, str],
        delta: tuple[Any, dict[str, deltas.FullSyncReason], int],
        timings: dict[str, float],
    ) -> RefreshOutcome:
        succeeded = [n for n in names if n not in failures]
        for name in succeeded:
            self.pool.restore(name)
        benched = []
        for name in failures:
            answer = answers.get(name, _NO_ANSWER)
            # dirty weights, or new weights whose engine label could not be set: never serve until repaired
            unsafe = answer.version == DIRTY or answer.ok
            if succeeded or unsafe:
                self.pool.bench(name, f"refresh to version {version} failed: {failures[name]}")
                benched.append(name)
        metrics = self.transport.metrics()
        detail = {**timings, **{f"{phase}_s": float(seconds) for phase, seconds in metrics.seconds.items()}}
        for answer in answers.values():  # the slowest server per phase, e.g. "server_load_s"
            for phase, seconds in answer.seconds.items():
                key = f"server_{phase}_s"
                detail[key] = max(detail.get(key, 0.0), seconds)
        weights, full_sync, sent = delta
        if isinstance(weights, deltas.DeltaPayload):
            detail.update(weights.summary())
        report = RefreshReport(
            version=int(version) if succeeded else self.current,
            transport=self.transport.name,
            seconds=timings["total_s"],
            servers={n: int(version) for n in succeeded},
            bytes=metrics.bytes + sent,
            tensors=metrics.tensors,
            buckets=metrics.buckets,
            detail=detail,
            kind="delta" if full_sync and len(full_sync) < len(names) else metrics.kind,
            full_sync=full_sync,
        )
        logger.info(
            "refresh to version %d via %s: %.3f s on %s (failed: %s)",
            version,
            self.transport.name,
            report.seconds,
            succeeded,
            sorted(failures),
        )
        return RefreshOutcome(report, failures, benched=bool(benched))
