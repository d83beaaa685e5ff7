"""The shared-memory transport: for servers on the trainer's host, buckets are files in a RAM-backed directory.

The trainer packs each bucket into its own file under ``<directory>/offgrpo-shm-<pid>-<id>/`` (``/dev/shm`` by
default) and sends one control call with the bucket layout; every worker maps the files and reloads from views
of them. Nothing crosses a socket and no worker allocates a receive buffer. The files live as long as the
transport and are rewritten in place on every refresh: on this kind of machine first-touching fresh memory
costs more than the copy itself (measured: packing 2 GB into fresh tmpfs pages 2.9 s, into the same pages
again 0.07 s; a worker mapping them 0.1 s), so the steady-state cost is one memcpy of the model.

Safety:
  * a worker reads the files only inside the control call, and vLLM's reload copies everything it loads into
    the model's own storage, so the files can be rewritten once every call answered;
  * when a call fails or times out (a worker may still be reading), the files are dropped and the next refresh
    writes new ones: a straggler never sees a half-rewritten bucket;
  * space is reserved with ``posix_fallocate`` before any write: a full tmpfs (Docker's default ``/dev/shm`` is
    64 MB) is a clear error, never a SIGBUS;
  * the files go with ``close()``, at interpreter exit (an exception ended the run), or, after a hard kill, with
    the next session: each holds an exclusive ``flock`` on its directory's lock file, and a new session removes
    directories whose owner died (locks die with their process, in any PID namespace).
The servers must see the same directory: the transport is for a fleet on the trainer's machine (or in its
container with a shared ``/dev/shm``); across hosts use the collective or disk transport.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_offgrpo.transports import _delta as deltas
from megatron_offgrpo.transports._adapter import AdapterSpec, split_payload
from megatron_offgrpo.transports._answers import WorkerAnswer
from megatron_offgrpo.transports._protocol import Buckets, TransferMetrics, WorkerTarget
from megatron_offgrpo.transports._rpc import call_targets
from megatron_offgrpo.transports._tensors import DEFAULT_BUCKET_BYTES, bucket_layout, bucket_stream, pack_into
from megatron_offgrpo.transports._worker_calls import LoadShm

SESSION_PREFIX = "offgrpo-shm-"
LOCK_NAME = "owner.lock"


@dataclass
class _Buffer:
    """One bucket's file and the trainer's mapping of it."""

    file: str
    nbytes: int
    data: torch.Tensor


class SharedMemoryTransport:
    """Pack buckets of >= ``bucket_bytes`` into persistent files under ``directory``; one load call per server.

    Attributes:
        directory: a RAM-backed directory the servers see at the same path (``/dev/shm``; in a container give it
            room: ``--shm-size`` or ``--ipc=host``). It holds one copy of the model while the transport lives.
        bucket_bytes: bytes per file (0: one file per tensor).
        timeout_s: bound on one server's map + checks + reload.
    """

    name = "shm"

    def __init__(
        self, directory: str | Path = "/dev/shm", bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0
    ) -> None:
        if bucket_bytes < 0:
            raise ValueError(
                f"SharedMemoryTransport bucket_bytes={bucket_bytes} must be >= 0 (0 = one file per tensor)"
            )
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(
                f"SharedMemoryTransport directory={str(self.directory)!r} is not a directory: give a RAM-backed "
                "directory the servers also see (default /dev/shm)"
            )
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._session: Path | None = None
        self._remove_session: weakref.finalize | None = None
        self._buffers: list[_Buffer] = []
        self._created = 0
        self._metrics = TransferMetrics()
        self._adapter: AdapterSpec | None = None  # what the prepared version is: an adapter, or the whole model
        self._delta: deltas.DeltaSpec | None = None  # ... or a delta (or a full version in delta mode)

    # ----- session: the directory this transport owns --------------------------------------------------------
    def _open_session(self) -> Path:
        if self._session is None:
            sweep_dead_sessions(self.directory)
            # Lock first, then publish under the final name, so a concurrent sweep never sees an unlocked session.
            staging = Path(tempfile.mkdtemp(prefix=".offgrpo-shm-new-", dir=self.directory))
            fd = os.open(staging / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            session = self.directory / f"{SESSION_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.rename(staging, session)
            self._session = session
            self._remove_session = weakref.finalize(self, _remove_session, session, fd)  # also runs at exit
        return self._session

    def _drop(self) -> None:
        """Forget every file (a worker may still read them): the next refresh writes new ones."""
        self._buffers = []
        if self._remove_session is not None:
            self._remove_session()
            self._session, self._remove_session = None, None

    def _buffer(self, index: int, nbytes: int) -> _Buffer:
        """Bucket ``index``'s file, reused when its size matches, else a new file with space reserved."""
        if index < len(self._buffers) and self._buffers[index].nbytes == nbytes:
            return self._buffers[index]
        session = self._open_session()
        name = f"bucket-{self._created}.bin"  # never reuse a name: a path always means one file's contents
        self._created += 1
        path = session / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as exc:
            path.unlink(missing_ok=True)
            if exc.errno != errno.ENOSPC:
                raise
            stat = os.statvfs(self.directory)
            raise OSError(
                errno.ENOSPC,
                f"the shm transport cannot reserve {nbytes / 1e6:.0f} MB in {self.directory} "
                f"({stat.f_bavail * stat.f_frsize / 1e6:.0f} MB free; it holds one copy of the model): enlarge it "
                "(docker run --shm-size=..., or --ipc=host), set rollout.shm_dir to a larger RAM-backed directory, "
                "or use the collective transport",
            ) from None
        finally:
            os.close(fd)
        buffer = _Buffer(name, nbytes, torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8))
        if index < len(self._buffers):
            (session / self._buffers[index].file).unlink(missing_ok=True)
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    # ----- WeightTransport -----------------------------------------------------------------------------------
    def prepare(self, weights: Buckets | Any, version: int) -> list[dict[str, Any]]:
        """Pack every bucket into its file (the servers still serve meanwhile); returns the layout they load."""
        start = time.perf_counter()
        weights, self._adapter = split_payload(weights)
        weights, self._delta = deltas.split_payload(weights)
        layout = []
        try:
            for bucket in bucket_stream(weights, version, self.bucket_bytes):
                if not bucket:
                    continue
                entries, nbytes = bucket_layout(bucket)
                buffer = self._buffer(len(layout), nbytes)
                pack_into(bucket, entries, buffer.data)
                layout.append({"file": buffer.file, "bytes": nbytes, "tensors": entries})
        except BaseException:
            self._drop()
            raise
        for stale in self._buffers[len(layout) :]:  # the model needs fewer files than last time
            (self._session / stale.file).unlink(missing_ok=True)
        del self._buffers[len(layout) :]
        self._metrics = TransferMetrics(
            {"write": time.perf_counter() - start},
            bytes=sum(b["bytes"] for b in layout),
            tensors=sum(len(b["tensors"]) for b in layout),
            buckets=len(layout),
            kind=deltas.kind_of(self._adapter, self._delta),
        )
        return layout

    def install(
        self, targets: list[WorkerTarget], prepared: list[dict[str, Any]], version: int
    ) -> dict[str, WorkerAnswer]:
        """Every target's workers map the files, check the tensor set and version, and reload, concurrently."""
        start = time.perf_counter()
        request = LoadShm(dir=str(self._session), version=int(version), buckets=prepared, adapter=self._adapter,
                          delta=self._delta)
        answers, _ = call_targets(targets, lambda i, t: request, self.timeout_s)
        if not all(a.ok for a in answers.values()):
            self._drop()
        self._metrics.seconds["call"] = time.perf_counter() - start
        return answers

    def metrics(self) -> TransferMetrics:
        """The last refresh's pack and call times and size (bytes, tensors, files)."""
        return self._metrics

    def close(self) -> None:
        """Remove this transport's files (workers hold no mapping outside a load call)."""
        self._drop()


def _remove_session(session: Path, lock_fd: int) -> None:
    shutil.rmtree(session, ignore_errors=True)
    os.close(lock_fd)


def sweep_dead_sessions(directory: Path) -> list[Path]:
    """Remove session directories under ``directory`` whose owner process is gone; returns them."""
    removed = []
    for session in directory.glob(f"{SESSION_PREFIX}*"):
        try:
            fd = os.open(session / LOCK_NAME, os.O_RDWR)
        except OSError:  # not a session of ours, or already being removed
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner is alive
            continue
        else:
            shutil.rmtree(session, ignore_errors=True)
            removed.append(session)
        finally:
            os.close(fd)
    return removed
