"""The worker-extension methods (``fleet.OffgrpoWorkerExtension``) as typed requests: the one place their names are
written, and the one definition of their arguments that the caller and the worker share.

A request is a frozen dataclass whose fields are the method's arguments and whose ``METHOD`` is the method's name.
On the wire (vLLM's ``collective_rpc``: in process, or through a fleet server's ``/collective_rpc``) a method takes
one JSON string, ``to_payload()``; the worker reads it back with ``from_payload`` of the same class, which refuses
missing and unknown fields by name. The in-process engine's tensor hand-over (``offgrpo_install_tensors``) passes
tensors, not JSON: ``INSTALL_TENSORS`` names it. A caller sends a request to a ``WorkerTarget`` (``target.call``) or
to many (``call_targets``); nothing else spells a method name.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar, TypeVar

from megatron_offgrpo.transports import _delta as deltas
from megatron_offgrpo.transports._adapter import AdapterSpec, spec_of

_Request = TypeVar("_Request", bound="WorkerRequest")

WORKER_EXTENSION = "megatron_offgrpo.fleet.OffgrpoWorkerExtension"
"""The dotted path vLLM loads as ``worker_extension_cls``: the class whose methods these requests call."""


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
    """One call of a worker-extension method: its name (``METHOD``) and its arguments (the fields)."""

    METHOD: ClassVar[str] = ""

    def to_payload(self) -> str:
        """The JSON string the worker's method takes."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_payload(cls: type[_Request], payload: str) -> _Request:
        """The request a worker received, refusing a payload that is not this method's arguments (naming them)."""
        args = json.loads(payload or "{}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        if not isinstance(args, dict) or not required <= set(args) <= names:
            raise ValueError(f"{cls.METHOD}: expected the arguments {sorted(names)} (required {sorted(required)}), "
                             f"got {sorted(args) if isinstance(args, dict) else type(args).__name__}")
        return cls(**args)


@dataclasses.dataclass(frozen=True)
class Info(WorkerRequest):
    """The worker's version, rank, pid, dtype, tensor count and token sampler."""

    METHOD: ClassVar[str] = "offgrpo_info"


@dataclasses.dataclass(frozen=True)
class RoutingBegin(WorkerRequest):
    """Record the experts every request is routed to from now on (router replay)."""

    METHOD: ClassVar[str] = "offgrpo_routing_begin"


@dataclasses.dataclass(frozen=True)
class RoutingTake(WorkerRequest):
    """The recorded routing of the sequences with these ``routing_key``s (answered as a ``RoutingAnswer``)."""

    METHOD: ClassVar[str] = "offgrpo_routing_take"
    keys: list[str]


@dataclasses.dataclass(frozen=True)
class _Install(WorkerRequest):
    """A request that installs a version: of the whole model, or (``adapter`` set) of the policy's LoRA adapter, whose
    tensors the request delivers as it delivers a full version's (``transports.adapters``), or (``delta`` set, its
    ``base`` a version) one blob per tensor patching the served version (``transports.deltas``; ``base`` None: a full
    version whose image the worker keeps for the deltas that follow)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapter", spec_of(self.adapter))  # type: ignore[attr-defined]  # JSON on the wire
        object.__setattr__(self, "delta", deltas.spec_of(self.delta))  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class LoadDir(_Install):
    """Install the version directory at ``path`` (the disk transport's) as ``version``."""

    METHOD: ClassVar[str] = "offgrpo_load_dir"
    path: str
    version: int
    adapter: AdapterSpec | None = None
    delta: deltas.DeltaSpec | None = None


@dataclasses.dataclass(frozen=True)
class JoinGroup(WorkerRequest):
    """Join the collective transport's broadcast group ``group_id``: its store at ``host:port`` holds the rendezvous
    under the secret ``key``; this worker's rank is ``rank_base`` plus its rank in its server."""

    METHOD: ClassVar[str] = "offgrpo_join_group"
    group_id: str
    key: str
    host: str
    port: int
    rank_base: int
    world_size: int
    timeout_s: float
    backend: str = "gloo"


@dataclasses.dataclass(frozen=True)
class LeaveGroup(WorkerRequest):
    """Forget the broadcast group ``group_id`` (its sockets close with it)."""

    METHOD: ClassVar[str] = "offgrpo_leave_group"
    group_id: str


@dataclasses.dataclass(frozen=True)
class Receive(_Install):
    """Receive one stream of ``version`` on group ``group_id``; ``commit``: install what was received (else stage it
    for a later commit)."""

    METHOD: ClassVar[str] = "offgrpo_receive"
    group_id: str
    version: int
    commit: bool = True
    adapter: AdapterSpec | None = None
    delta: deltas.DeltaSpec | None = None


@dataclasses.dataclass(frozen=True)
class LoadShm(_Install):
    """Map the shared-memory bucket files under ``dir`` and install them as ``version``. ``buckets``: per file its
    ``file`` name, ``bytes`` written and ``tensors`` (``pack_into``'s entries), as ``SharedMemoryTransport.prepare``
    lays them out."""

    METHOD: ClassVar[str] = "offgrpo_load_shm"
    dir: str
    version: int
    buckets: list[dict[str, object]]
    adapter: AdapterSpec | None = None
    delta: deltas.DeltaSpec | None = None


INSTALL_TENSORS = "offgrpo_install_tensors"
"""The in-process hand-over: ``collective_rpc(INSTALL_TENSORS, args=(tensors, version, adapter, delta))``, tensors in
memory (``adapter``: None for a full version, else the ``AdapterSpec``'s wire form; ``delta``: the ``DeltaSpec``'s)."""

REQUESTS: tuple[type[WorkerRequest], ...] = (Info, RoutingBegin, RoutingTake, LoadDir, JoinGroup, LeaveGroup, Receive,
                                             LoadShm)
