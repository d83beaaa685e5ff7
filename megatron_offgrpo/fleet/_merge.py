"""One client view of several fleets (e.g. one per node of a Slurm job): ``offgrpo fleet merge``."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from megatron_offgrpo.fleet._auth import TOKEN_ENV
from megatron_offgrpo.fleet._claim import claim_state_dir
from megatron_offgrpo.fleet._state import FleetState, ServerRecord, load_state


def merge_states(sources: Sequence[str | Path], target_dir: str | Path) -> FleetState:
    """Write ``<target_dir>/fleet.json``: one client view of the servers of several fleets (e.g. one per node).

    The trainer reads one fleet state (``rollout.fleet_state``); a multi-node job starts one fleet per node and
    merges their states. The merged state keeps each server's name and URL but no pid (a pid means something
    only on its own node), so ``stop_fleet`` refuses it and ``fleet_status`` reports health only.

    Raises:
        ValueError: no sources, or fleets that differ in model, served name, LoRA adapter, runner or token, or share a
            server name/URL.
        FleetRunning: ``target_dir`` holds a fleet that still runs (or one being started).
        FileNotFoundError: a source has no fleet state.
    """
    if not sources:
        raise ValueError("merge: give at least one source fleet state (the --state-dir of each `offgrpo fleet start`)")
    states = [load_state(source) for source in sources]
    errors = []
    for key in ("model_dir", "served_model_name", "lora", "runner"):
        values = sorted({str(getattr(state, key)) for state in states})
        if len(values) > 1:
            errors.append(f"{key} differs between the fleets ({values}): every fleet must serve the same model")
    tokens = {Path(s.token_file).read_text().strip() if s.token_file else None for s in states}
    if len(tokens) > 1:
        errors.append("the fleets have different tokens: start them with one token (the same $" + TOKEN_ENV + ")")
    servers = [
        ServerRecord(server.name, server.url, server.port, server.log) for state in states for server in state.servers
    ]
    for key in ("name", "url"):
        values = [getattr(server, key) for server in servers]
        if len(set(values)) != len(values):
            errors.append(
                f"server {key}s repeat across the fleets ({sorted(values)}): bind each fleet to its node's "
                "host name (--host), not a loopback or wildcard address"
            )
    if errors:
        raise ValueError("cannot merge the fleet states:\n  " + "\n  ".join(errors))
    merged = FleetState(
        model_dir=states[0].model_dir,
        served_model_name=states[0].served_model_name,
        token_file=states[0].token_file,
        servers=servers,
        merged_from=[str(Path(source).resolve()) for source in sources],
        lora=states[0].lora,
        runner=states[0].runner,
    )
    with claim_state_dir(target_dir):  # a fleet started there runs on: its record is never replaced by a view
        merged.write(target_dir)  # readers (the trainer, status) never see a half-written file
    return merged
