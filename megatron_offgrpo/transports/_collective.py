"""The collective transport: the trainer broadcasts bucketed tensors to every server worker over a private group.

Rank 0 is the trainer (its rank 0, or one process per PP stage sending its own layers in turn); ranks 1.. are the
workers of the servers, which join through the ``offgrpo_join_group`` worker RPC. The group is gloo over TCP on
CPU and NCCL on GPU (``backend``). It is built on the first refresh and rebuilt whenever the set of servers
changes (a server died or came back).
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any

import torch

from megatron_offgrpo.transports import _delta as deltas
from megatron_offgrpo.transports._adapter import AdapterSpec, split_payload
from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._gloo import make_group, make_store, send_stream
from megatron_offgrpo.transports._protocol import Buckets, TransferMetrics, WorkerTarget
from megatron_offgrpo.transports._rpc import call_targets
from megatron_offgrpo.transports._tensors import DEFAULT_BUCKET_BYTES, bucket_stream
from megatron_offgrpo.transports._worker_calls import Info, JoinGroup, LeaveGroup, Receive


class CollectiveTransport:
    """Broadcast buckets of >= ``bucket_bytes`` (0: one tensor per message) to all workers in one control call.

    Attributes:
        host: address the servers reach the trainer's rendezvous store on; the store listens on this address only
            (loopback by default). port: its port (0: pick a free one).
        backend: "gloo" (CPU) or "nccl" (GPU). device: where rank 0's buffers live ("cuda" for NCCL).
        timeout_s: bound on joining and on each collective operation (a dead peer surfaces within it).
    Every install is one complete reload: vLLM's in-place reload of part of a fused layer (e.g. q_proj alone)
    corrupts the rest of the layer. (The workers can also stage streams sent with ``commit=False`` until a
    committing one: ``benchmarks/_baselines.py`` measures the peers' one-call-per-tensor pattern with it.)
    """

    name = "collective"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        backend: str = "gloo",
        device: str = "cpu",
        timeout_s: float = 120.0,
    ) -> None:
        if bucket_bytes < 0:
            raise ValueError(
                f"CollectiveTransport bucket_bytes={bucket_bytes} must be >= 0 (0 = one tensor per message)"
            )
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"CollectiveTransport backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")
        self.host, self.port, self.bucket_bytes = host, port, bucket_bytes
        self.backend, self.device, self.timeout_s = backend, torch.device(device), timeout_s
        self._store = None
        self._group = None
        self._group_id = ""
        self._members: tuple[str, ...] = ()
        self._metrics = TransferMetrics()
        self._adapter: AdapterSpec | None = None  # what the prepared version is: an adapter, or the whole model
        self._delta: deltas.DeltaSpec | None = None  # ... or a delta (or a full version in delta mode)

    def _ensure_group(self, targets: list[WorkerTarget]) -> None:
        names = tuple(t.name for t in targets)
        if self._group is not None and names == self._members:
            return
        if self._store is None:
            self._store = make_store(self.host, self.port, None, True, self.timeout_s)
        old = self._group_id
        infos, _ = call_targets(targets, lambda i, t: Info(), self.timeout_s)
        bad = {n: a.error for n, a in infos.items() if not a.ok}
        if bad:
            raise ConnectionError(f"cannot build the refresh group: servers {bad} did not answer offgrpo_info")
        bases, world = [], 1
        for target in targets:
            bases.append(world)
            world += infos[target.name].workers
        group_id = uuid.uuid4().hex[:12]  # the group's name (logged); its rendezvous keys sit under the secret key
        key = secrets.token_hex(16)
        answers, group = call_targets(
            targets,
            lambda i, t: JoinGroup(group_id=group_id, key=key, host=self.host, port=self._store.port,
                                   rank_base=bases[i], world_size=world, timeout_s=self.timeout_s,
                                   backend=self.backend),
            self.timeout_s,
            background=lambda: make_group(self._store, key, 0, world, self.timeout_s, self.backend),
        )
        bad = {n: a.error for n, a in answers.items() if not a.ok}
        if bad:
            raise ConnectionError(f"servers {bad} failed to join the refresh group")
        self._group, self._group_id, self._members = group, group_id, names
        if old:
            call_targets(targets, lambda i, t: LeaveGroup(group_id=old), 30.0)

    def prepare(self, weights: Buckets | Any, version: int) -> Buckets:
        """Wrap the lazy bucket stream (a directory is read and sent, for symmetry with the disk transport)."""
        weights, self._adapter = split_payload(weights)
        weights, self._delta = deltas.split_payload(weights)
        return bucket_stream(weights, version, self.bucket_bytes)

    def install(self, targets: list[WorkerTarget], prepared: Buckets, version: int) -> dict[str, WorkerAnswer]:
        """Join (or rebuild) the group, then broadcast while every worker receives, checks and loads."""
        start = time.perf_counter()
        self._ensure_group(targets)
        joined = time.perf_counter()
        try:
            answers, stats = self._send(targets, prepared, version)
        except BaseException:
            self._group, self._members = None, ()  # a failed stream may leave the group out of step: rebuild next time
            raise
        self._metrics = TransferMetrics({"join": joined - start, "send": time.perf_counter() - joined}, **stats,
                                        kind=deltas.kind_of(self._adapter, self._delta))
        return answers

    def _send(
        self, targets: list[WorkerTarget], buckets: Buckets, version: int
    ) -> tuple[dict[str, WorkerAnswer], dict]:
        """Every bucket in one stream, installed by the workers at its end: (answers, send stats)."""
        return self._stream(targets, buckets, version, commit=True)

    def _stream(
        self, targets: list[WorkerTarget], buckets: Buckets, version: int, commit: bool
    ) -> tuple[dict[str, WorkerAnswer], dict]:
        request = Receive(group_id=self._group_id, version=int(version), commit=commit, adapter=self._adapter,
                          delta=self._delta)
        return call_targets(
            targets,
            lambda i, t: request,
            self.timeout_s,
            background=lambda: send_stream(self._group, buckets, version, self.device),
        )

    def metrics(self) -> TransferMetrics:
        """The last refresh's join and send times and size (bytes, tensors, messages)."""
        return self._metrics

    def close(self) -> None:
        """Drop the group and the store (the servers drop theirs on the next join)."""
        self._group, self._store, self._members = None, None, ()
