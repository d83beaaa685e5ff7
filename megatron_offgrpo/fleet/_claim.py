"""One fleet per state directory: a start refuses a directory whose recorded fleet still runs, or that another start
is filling right now.

A second start used to overwrite ``fleet.json`` and the token: the first fleet ran on with a token no file held,
and ``stop`` could no longer find it. ``claim_state_dir`` holds an exclusive ``flock`` on ``<state_dir>/fleet.lock``
for the whole start (check, spawn, record, wait), so two starts at once cannot both pass the check; the kernel
drops the lock when the starting process ends, however it ends, so a killed start never blocks the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import Iterator

from megatron_offgrpo.fleet._processes import describe_servers, running_servers
from megatron_offgrpo.fleet._state import load_state

LOCK_FILE = "fleet.lock"


class FleetRunning(ValueError):
    """The state directory belongs to a fleet that still runs, or to a start in progress."""


@contextlib.contextmanager
def claim_state_dir(state_dir: str | Path) -> Iterator[str | None]:
    """Hold ``state_dir`` for one start; yields a note when it replaces the record of a fleet no longer running.

    Raises:
        FleetRunning: another start holds the directory, or its recorded fleet still runs (nothing written).
        ValueError: its ``fleet.json`` is not a fleet state (whose servers may run: never overwritten blindly).
    """
    state_dir = Path(state_dir)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:  # a file of that name, no permission, a read-only file system
        raise ValueError(f"--state-dir={state_dir}: cannot hold a fleet's state there ({exc.strerror}: "
                         f"{exc.filename}): choose a directory you can write") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FleetRunning(_busy_message(state_dir)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid()}).encode(), 0)  # who holds it, for the message above
        yield recorded_fleet_note(state_dir)
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would let two starts lock two files)


def check_state_dir(state_dir: str | Path) -> str | None:
    """``claim_state_dir``'s verdict now, without keeping the claim (the CLI's early answer, before it prints
    anything; ``start_fleet`` checks again under the lock)."""
    with claim_state_dir(state_dir) as note:
        return note


def recorded_fleet_note(state_dir: Path) -> str | None:
    """None: nothing recorded. A note: the recorded fleet no longer runs (its record is replaced).

    Raises:
        FleetRunning: some of its servers still run.
    """
    if not (state_dir / "fleet.json").is_file():
        return None
    state = load_state(state_dir)
    if state.merged_from:  # a client view: its fleets run under their own directories, untouched by this one
        return f"{state_dir / 'fleet.json'}: replacing the merged view of {state.merged_from}"
    running = running_servers(state)
    if running:
        raise FleetRunning(
            f"{state_dir}: a fleet runs there ({describe_servers(running)}): stop it first "
            f"(offgrpo fleet stop --state-dir {state_dir}) or choose another --state-dir"
        )
    return f"{state_dir / 'fleet.json'}: its fleet ({describe_servers(state.servers)}) no longer runs: replacing it"


def _busy_message(state_dir: Path) -> str:
    try:
        holder = json.loads((state_dir / LOCK_FILE).read_text() or "{}").get("pid")
    except (OSError, ValueError, AttributeError):
        holder = None
    who = f" (pid {holder})" if holder else ""
    return (f"{state_dir}: another `offgrpo fleet start`{who} is starting a fleet there: wait for it, then see "
            f"`offgrpo fleet status --state-dir {state_dir}`")
