"""The fleet's record (``<state-dir>/fleet.json``): what the launcher started, what clients connect to."""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

from megatron_offgrpo.fleet._auth import TOKEN_ENV
from megatron_offgrpo.fleet._runner import Runner

PID_MAX = 2**31 - 1
"""The largest pid_t: a larger number overflows os.killpg instead of naming no process."""


@dataclasses.dataclass
class ServerRecord:
    """One server of a fleet.

    Attributes:
        name: its label (e.g. "s0@127.0.0.1:8100"). url: "http://host:port". port: its port.
        log: the server's log file. pid: the process (group) the launcher started; None in a merged state (a pid
            means something only on its own node). cores: the CPU cores it is pinned to (None: not pinned).
    """

    name: str
    url: str
    port: int | None = None
    log: str | None = None
    pid: int | None = None
    cores: list[int] | None = None


@dataclasses.dataclass
class FleetState:
    """A recorded fleet.

    Attributes:
        model_dir: the HF directory every server loaded. served_model_name: the model name requests use.
        token_file: the 0600 file holding the fleet's token (None: no token). servers: one record per server.
        size: the launcher's per-server sizing (``ServerSize`` as a dict; absent in a merged state).
        merged_from: the source state directories of a merged view (``merge_states``); None for a started fleet.
        lora: the policy's LoRA adapter the servers serve (``transports.adapters.AdapterSpec`` in its wire form;
            requests then name ``adapters.LORA_NAME``); None: no LoRA.
        runner: what the servers run (``fleet._runner.Runner``): ``generate``, or ``pooling`` for a sequence
            classifier (a reward model scored through ``/classify``). A state written before the field: ``generate``.
    """

    model_dir: str
    served_model_name: str
    token_file: str | None
    servers: list[ServerRecord]
    size: dict[str, Any] | None = None
    merged_from: list[str] | None = None
    lora: dict[str, Any] | None = None
    runner: Runner = "generate"

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as ``fleet.json`` (a server's None fields left out: a merged state keeps no pid)."""
        out = dataclasses.asdict(self)
        out["servers"] = [{k: v for k, v in s.items() if v is not None} for s in out["servers"]]
        return {k: v for k, v in out.items() if v is not None or k == "token_file"}

    @classmethod
    def from_json(cls, data: Any) -> "FleetState":
        """Read a ``fleet.json`` object, every field checked against its type once (unknown keys are ignored: a newer
        writer may add some).

        Raises:
            ValueError: one line naming the first bad field (``servers[1].pid: 'abc' is not an integer``).
        """
        state = _record(cls, data, "")
        if not state.servers:
            raise ValueError("servers: empty (a fleet has at least one server)")
        for i, server in enumerate(state.servers):
            # a pid of 0 or below addresses our own process group (killpg(0)): never from a file
            if server.pid is not None and not 1 <= server.pid <= PID_MAX:
                raise ValueError(f"servers[{i}].pid: {server.pid} is not a process id (1..{PID_MAX})")
            if server.port is not None and not 1 <= server.port <= 65535:
                raise ValueError(f"servers[{i}].port: {server.port} is not a port (1..65535)")
        return state

    def write(self, state_dir: str | Path) -> Path:
        """Write ``<state_dir>/fleet.json`` atomically (readers never see a half-written file); returns its path."""
        target = Path(state_dir)
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / "fleet.json.tmp"
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, target / "fleet.json")
        return target / "fleet.json"


def load_state(state_file: str | Path) -> FleetState:
    """The recorded fleet (``fleet.json``; a directory means its ``fleet.json``)."""
    path = Path(state_file)
    state_dir = path if path.suffix != ".json" else path.parent  # a directory, or a fleet.json (that may be missing)
    path = path / "fleet.json" if path.suffix != ".json" else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no fleet state: start one with `offgrpo fleet start --state-dir {state_dir}`")
    try:
        return FleetState.from_json(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        # a torn write of an older version, a hand edit: name the file and the field, not a parser's position alone
        what = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{path}: not a fleet state ({what}): stop its servers by hand if any run, then remove it "
                         f"and start the fleet again (`offgrpo fleet start --state-dir {state_dir}`)") from None


def _record(cls: type, data: Any, where: str) -> Any:
    """The dataclass ``cls`` built from the JSON object ``data``, each field checked by ``_typed`` (``where``: the
    path of ``data`` in the file, for the message)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the file'}: {_shown(data)} is not a JSON object")
    hints = typing.get_type_hints(cls)
    values = {}
    for field in dataclasses.fields(cls):
        key = f"{where}.{field.name}" if where else field.name
        if field.name in data:
            values[field.name] = _typed(data[field.name], hints[field.name], key)
        elif field.default is dataclasses.MISSING:
            if not _optional(hints[field.name]):
                raise ValueError(f"{key}: missing")
            values[field.name] = None  # an optional field left out (an older writer, a hand-written state)
    return cls(**values)


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against ``hint``: a dataclass, ``list[X]``, ``dict[str, Any]``, ``X | None``, a ``Literal``
    of strings, str, int."""
    if typing.get_origin(hint) is typing.Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{where}: {_shown(value)} is not one of {list(typing.get_args(hint))}")
        return value
    if _optional(hint):
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return None if value is None else _typed(value, inner[0], where)
    if dataclasses.is_dataclass(hint):
        return _record(hint, value, where)
    origin = typing.get_origin(hint) or hint
    expected = {list: (list, "a list"), dict: (dict, "a JSON object"), str: (str, "a string"), int: (int, "an integer")}
    kind, name = expected[origin]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):  # JSON true is no pid
        raise ValueError(f"{where}: {_shown(value)} is not {name}")
    if origin is list:
        return [_typed(item, typing.get_args(hint)[0], f"{where}[{i}]") for i, item in enumerate(value)]
    return value


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (types.UnionType, typing.Union) and type(None) in typing.get_args(hint)


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def fleet_token(state: FleetState) -> str | None:
    """The token: ``$OFFGRPO_FLEET_TOKEN`` if set, else the fleet's token file, else None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    return Path(state.token_file).read_text().strip() if state.token_file else None
