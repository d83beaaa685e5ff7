"""A private broadcast group between the trainer (rank 0) and the fleet's workers, and the bucket stream on it.

No default process group is needed on either side: each member builds a ``TCPStore`` client of the trainer's
store and a ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) over a prefix of it, so the group lives
next to megatron's groups in the trainer and next to vLLM's own groups in each worker.

The stream is a sequence of messages, each a broadcast of a fixed header ``int64[3] = (kind, meta_len,
buf_len)``, then ``meta_len`` bytes of JSON, then ``buf_len`` bytes of tensor data:
    kind 1  a bucket: JSON from ``pack_bucket``, data = the packed buffer
    kind 2  end: JSON {"version", "buckets", "bytes"}: the receivers check the counts
    kind 3  abort: JSON {"reason"}: the sender failed mid-stream; receivers drop what they got
"""

from __future__ import annotations

import datetime
import json
import queue
import socket
import threading
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import BroadcastOptions, PrefixStore

from megatron_offgrpo.transports._tensors import Named, pack_bucket, unpack_bucket

BUCKET, END, ABORT = 1, 2, 3
CPU = torch.device("cpu")  # the streams' default device


def make_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store: the trainer hosts it (``port`` 0 picks a free port, read back as ``store.port``).

    The host's store listens on ``host``'s address only (loopback for a fleet on this machine), not on every
    interface as a plain ``TCPStore(is_master=True)`` does: it binds the listening socket itself and hands it over.
    The store authenticates nobody; the groups on it live under keys only the fleet's workers learn (``make_group``).

    Raises:
        ValueError: ``host`` does not resolve to an address of this machine (the host's side only).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    listener = listening_socket(host, port)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now (it closes it)
    return store


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``'s first address here and ``port`` (0: a free one), listening.

    Raises:
        ValueError: ``host`` does not resolve, or its address is not one of this machine's.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ValueError(f"refresh store host {host!r} does not resolve here ({exc}): set rollout.collective_host to "
                         "an address of this machine that the fleet's servers reach") from None
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise ValueError(f"refresh store host {host!r} ({address[0]}): cannot listen there ({exc}): set rollout."
                         "collective_host to an address of this machine that the fleet's servers reach") from None
    return listener


def make_group(store: dist.Store, key: str, rank: int, world_size: int, timeout_s: float, backend: str = "gloo"):
    """Join the broadcast group whose rendezvous keys sit under ``key`` (blocks until all ``world_size`` members
    joined).

    The trainer draws ``key`` at random for each group (128 bits) and sends it to the workers over the fleet's
    token-checked HTTP control path only: a client of the store without it cannot read the members' addresses or
    take a rank (the store lists no keys). The group's data connections themselves are neither authenticated nor
    encrypted (gloo/NCCL): see docs/guide.md.

    Raises:
        ValueError: for a backend other than "gloo" or "nccl".
    """
    prefixed = PrefixStore(f"offgrpo/{key}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        from torch._C._distributed_c10d import ProcessGroupGloo

        return ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        from torch._C._distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"backend={backend!r}: the refresh group supports 'gloo' (CPU) and 'nccl' (GPU)")


def _bcast(group, tensor: torch.Tensor) -> torch.Tensor:
    opts = BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()
    return tensor


def _message(group, kind: int, meta: bytes, buffer: torch.Tensor | None, device: torch.device) -> None:
    header = torch.tensor([kind, len(meta), 0 if buffer is None else buffer.numel()], dtype=torch.int64, device=device)
    _bcast(group, header)
    _bcast(group, torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device))
    if buffer is not None and buffer.numel():
        _bcast(group, buffer.to(device))


def _packed(buckets: Iterable[Named], depth: int = 1) -> Iterator[tuple[bytes, torch.Tensor, int]]:
    """Export and pack the next bucket in a helper thread while the caller broadcasts the current one.

    Yields (header, buffer, tensor count); an exception of the producer is re-raised here, in order.
    """
    done = object()
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> None:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def produce() -> None:
        try:
            for bucket in buckets:
                if stop.is_set():
                    return
                if bucket:
                    put((*pack_bucket(bucket), len(bucket)))
            put(done)
        except BaseException as exc:  # handed to the consumer
            put(exc)

    thread = threading.Thread(target=produce, daemon=True, name="offgrpo-pack")
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is done:
                break
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()  # a consumer that stops early (a failed broadcast) releases the producer
        thread.join(5.0)


def send_stream(
    group, buckets: Iterable[Named], version: int, device: torch.device = CPU
) -> dict[str, int]:
    """Broadcast ``buckets`` then an end message from rank 0; on an exception mid-stream, broadcast an abort.

    The next bucket is exported and packed in a helper thread while the current one is on the wire.

    Returns:
        {"bytes", "buckets", "tensors"} sent.
    """
    stats = {"bytes": 0, "buckets": 0, "tensors": 0}
    try:
        for meta, buffer, count in _packed(buckets):
            _message(group, BUCKET, meta, buffer, device)
            stats["bytes"] += buffer.numel()
            stats["buckets"] += 1
            stats["tensors"] += count
    except BaseException as exc:
        _message(group, ABORT, json.dumps({"reason": f"{type(exc).__name__}: {exc}"}).encode(), None, device)
        raise
    _message(
        group,
        END,
        json.dumps({"version": int(version), "buckets": stats["buckets"], "bytes": stats["bytes"]}).encode(),
        None,
        device,
    )
    return stats


def recv_stream(group, device: torch.device = CPU) -> Iterator[tuple[int, Any]]:
    """Receive messages until end/abort: yields (BUCKET, named tensors) ..., then (END, meta) or (ABORT, meta)."""
    while True:
        header = _bcast(group, torch.empty(3, dtype=torch.int64, device=device)).tolist()
        kind, meta_len, buf_len = (int(x) for x in header)
        meta = bytes(_bcast(group, torch.empty(meta_len, dtype=torch.uint8, device=device)).cpu().numpy().tobytes())
        if kind == BUCKET:
            buffer = (
                _bcast(group, torch.empty(buf_len, dtype=torch.uint8, device=device))
                if buf_len
                else torch.empty(0, dtype=torch.uint8)
            )
            yield BUCKET, unpack_bucket(meta, buffer)
            continue
        yield kind, json.loads(meta)
        return
