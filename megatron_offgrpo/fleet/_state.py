"""The fleet's record (``<state-dir>/fleet.json``): what the launcher started, what clients connect to."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from megatron_offgrpo.fleet._auth import TOKEN_ENV


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
    """

    model_dir: str
    served_model_name: str
    token_file: str | None
    servers: list[ServerRecord]
    size: dict[str, Any] | None = None
    merged_from: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as ``fleet.json`` (a server's None fields left out: a merged state keeps no pid)."""
        out = dataclasses.asdict(self)
        out["servers"] = [{k: v for k, v in s.items() if v is not None} for s in out["servers"]]
        return {k: v for k, v in out.items() if v is not None or k == "token_file"}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "FleetState":
        """Read a ``fleet.json`` object (unknown keys are ignored: a newer writer may add some)."""
        fields = {f.name for f in dataclasses.fields(ServerRecord)}
        servers = [ServerRecord(**{k: v for k, v in s.items() if k in fields}) for s in data.get("servers", [])]
        return cls(
            model_dir=data["model_dir"],
            served_model_name=data["served_model_name"],
            token_file=data.get("token_file"),
            servers=servers,
            size=data.get("size"),
            merged_from=data.get("merged_from"),
        )

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
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
        # a torn write of an older version, a hand edit: name the file, not a JSON parser's position alone
        what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{path}: not a fleet state ({what}): stop its servers by hand if any run, then start the "
                         f"fleet again (`offgrpo fleet start --state-dir {state_dir}`)") from None


def fleet_token(state: FleetState) -> str | None:
    """The token: ``$OFFGRPO_FLEET_TOKEN`` if set, else the fleet's token file, else None."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    return Path(state.token_file).read_text().strip() if state.token_file else None
