"""What an engine is built from: one typed spec per engine kind, the argument of ``make_engine``.

A spec holds every setting its engine takes, named and typed, so that a caller cannot pass a setting that kind
ignores, and nothing set on the way (``rollout.mode=async_partial``, router replay) is lost between the config and
the engine. The engine says back what it can do through the protocol's capabilities (``concurrent_generate``,
``partial_rollouts``), never through ``getattr``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Union

from megatron_offgrpo.transports import WeightTransport, adapters

Dtype = Literal["auto", "float32", "bfloat16"]
"""The serving dtype, by vLLM's names ("auto": vLLM's choice; the transformers engine then serves float32)."""


@dataclasses.dataclass(frozen=True)
class VllmSpec:
    """The in-process vLLM engine (``VLLMEngine``).

    Attributes:
        model_dir: the HF model directory it serves as version 0.
        dtype: what it generates in. max_model_len: the longest prompt + completion. max_num_seqs: sequences
            generated at once (with ``max_model_len`` it sizes the KV cache).
        record_routing: MoE models: every sample carries its routing (router replay).
        partial_rollouts: a refresh lands between two decode steps of the requests in flight.
        fall_back: ``rollout.engine=auto``: when vLLM is missing or cannot serve the model, the transformers engine
            serves it instead, with a one-line warning naming why (else the error is raised); never with ``lora``.
        lora: the policy's LoRA adapter when refreshes send only it (``lora.sync=adapter``): the engine starts with
            vLLM's LoRA on, serving every request with the adapter (version 0: all zero); None: full refreshes
            (no LoRA, or ``lora.sync=merged``).
    """

    model_dir: Path
    dtype: Dtype = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    record_routing: bool = False
    partial_rollouts: bool = False
    fall_back: bool = False
    lora: adapters.AdapterSpec | None = None


@dataclasses.dataclass(frozen=True)
class TransformersSpec:
    """Plain HF ``generate`` (``TransformersEngine``): machines without vLLM, and the fall-back of ``auto``."""

    model_dir: Path
    dtype: Dtype = "float32"
    record_routing: bool = False


@dataclasses.dataclass(frozen=True)
class FleetClientSpec:
    """The client of a fleet that ``offgrpo fleet start`` recorded (``FleetEngine``).

    Attributes:
        state: the fleet's ``--state-dir`` or its ``fleet.json``.
        transport: how refreshes travel ("disk", "collective", "shm"), or a transport object.
        shared_dir: disk: the directory every server reads versions from (None: a new temporary directory, enough
            when the servers run on this machine). bucket_bytes: bucket size of collective and shm (None: default).
        hf_config: the model's HF config, written beside each disk version.
        collective_host: collective: where the servers' workers dial this process (None: 127.0.0.1).
        shm_dir: shm: a RAM-backed directory the servers see too.
        record_routing, partial_rollouts: as for ``VllmSpec``.
        lora: as for ``VllmSpec``; the fleet must have been started with the same adapter spec
            (``offgrpo fleet start``'s LoRA settings, recorded in its state).
    """

    state: Path
    transport: Literal["disk", "collective", "shm"] | WeightTransport = "disk"
    shared_dir: Path | None = None
    bucket_bytes: int | None = None
    hf_config: dict[str, object] | None = None
    collective_host: str | None = None
    shm_dir: Path = Path("/dev/shm")
    record_routing: bool = False
    partial_rollouts: bool = False
    lora: adapters.AdapterSpec | None = None


EngineSpec = Union[VllmSpec, TransformersSpec, FleetClientSpec]
