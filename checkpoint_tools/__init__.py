"""checkpoint_tools: the one Qwen HF <-> megatron weight map, offline conversions and the live streaming export."""

from checkpoint_tools._check import dist_dir_errors, hf_dir_errors
from checkpoint_tools._convert import (
    MegatronCheckpoint,
    megatron_to_hf_dir,
    write_hf,
)
from checkpoint_tools._dist import (
    DIST_MODEL_KEY,
    DistModelCard,
    checkpoint_kind,
    resolve_checkpoint,
    dist_checkpoint_to_hf_dir,
    load_model_part,
    megatron_to_hf_any,
    read_model_card,
    write_model_card,
)
from checkpoint_tools._dist_write import hf_to_dist_dir
from checkpoint_tools._io import (
    HF_INDEX,
    CheckpointError,
    atomic_output_dir,
    open_safetensors_dir,
    read_manifest,
    sweep_stale_siblings,
    tensor_record,
    write_manifest,
)
from checkpoint_tools._live import Named, is_extra_state, load_hf_into_stage, rebucket, stream_hf_buckets
from checkpoint_tools._mapping import UnknownTensorError, hf_names
from checkpoint_tools._shapes import expected_hf_shapes, hf_shapes
from checkpoint_tools._state_dict import hf_to_state_dict, state_dicts_to_hf
from checkpoint_tools._safetensors_stream import CODE_DTYPES, DTYPE_CODES, StreamingSafetensorsWriter

__all__ = [
    "CODE_DTYPES",
    "DIST_MODEL_KEY",
    "DTYPE_CODES",
    "HF_INDEX",
    "CheckpointError",
    "DistModelCard",
    "MegatronCheckpoint",
    "Named",
    "StreamingSafetensorsWriter",
    "UnknownTensorError",
    "atomic_output_dir",
    "checkpoint_kind",
    "resolve_checkpoint",
    "dist_checkpoint_to_hf_dir",
    "dist_dir_errors",
    "expected_hf_shapes",
    "hf_dir_errors",
    "hf_names",
    "hf_shapes",
    "hf_to_dist_dir",
    "hf_to_state_dict",
    "is_extra_state",
    "load_model_part",
    "load_hf_into_stage",
    "megatron_to_hf_any",
    "megatron_to_hf_dir",
    "open_safetensors_dir",
    "read_manifest",
    "read_model_card",
    "state_dicts_to_hf",
    "sweep_stale_siblings",
    "rebucket",
    "stream_hf_buckets",
    "tensor_record",
    "write_hf",
    "write_manifest",
    "write_model_card",
]
