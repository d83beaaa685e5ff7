"""checkpoint_tools: the one Qwen HF <-> megatron weight map, offline conversions and the live streaming export.

On the door, what most users need: the live load and export of a model stage (``load_hf_into_stage``,
``stream_hf_buckets`` and its ``Named`` tensors, ``rebucket``), HF directories read and written
(``open_safetensors_dir``, ``write_hf``), the HF shapes of a model (``hf_shapes``, ``expected_hf_shapes``) and the one
``CheckpointError``. The cohesive sets beside them, each one name for a whole module:

- ``adapters``: LoRA adapters: megatron's factors -> PEFT's (``adapter_to_peft``), the merge (``merge_shard``), their
  description (``LoraCard``, ``card_of_model``), the PEFT directory (``write_peft``, ``peft_shapes``); the streaming
  export's ``adapter=`` ("merge" | "only", ``AdapterExport``) chooses merged HF weights or the PEFT adapter;
- ``dist_ckpt``: megatron dist checkpoints, the trainer's format: ``DIST_MODEL_KEY``, the card (``DistModelCard``,
  ``read_model_card`` / ``write_model_card``), ``resolve_checkpoint``, ``checkpoint_kind``, ``load_model_part``, the
  export (``dist_checkpoint_to_hf_dir``, ``megatron_to_hf_any``);
- ``files``: checkpoint files: atomic output directories (``atomic_output_dir``, ``sweep_stale_siblings``), manifests
  with checksums (``write_manifest``, ``read_manifest``, ``tensor_record``), ``HF_INDEX``;
- ``safetensors_stream``: safetensors written a tensor at a time (``StreamingSafetensorsWriter``) and the dtype codes
  (``DTYPE_CODES`` / ``CODE_DTYPES``);
- ``checks``: a HF directory or dist checkpoint checked from headers alone (``hf_dir_errors``, ``dist_dir_errors``);
- ``state_dicts``: a stage's megatron state dicts <-> HF tensors in one process (``hf_to_state_dict``,
  ``state_dicts_to_hf``).

The offline conversions run as ``python -m checkpoint_tools.hf_to_megatron`` / ``megatron_to_hf`` / ``roundtrip``.
"""

from checkpoint_tools import _adapter as adapters  # adapters.LoraCard, adapters.write_peft(...), ...
from checkpoint_tools import _check as checks  # checks.hf_dir_errors(...), checks.dist_dir_errors(...)
from checkpoint_tools import _dist as dist_ckpt  # dist_ckpt.DistModelCard, dist_ckpt.resolve_checkpoint(...), ...
from checkpoint_tools import _io as files  # files.atomic_output_dir(...), files.write_manifest(...), ...
from checkpoint_tools import _safetensors_stream as safetensors_stream  # safetensors_stream.StreamingSafetensorsWriter
from checkpoint_tools import _state_dict as state_dicts  # state_dicts.hf_to_state_dict(...), state_dicts_to_hf(...)
from checkpoint_tools._convert import write_hf
from checkpoint_tools._io import CheckpointError, open_safetensors_dir
from checkpoint_tools._live import Named, load_hf_into_stage, rebucket, stream_hf_buckets
from checkpoint_tools._shapes import expected_hf_shapes, hf_shapes

__all__ = [
    "CheckpointError",
    "Named",
    "adapters",
    "checks",
    "dist_ckpt",
    "expected_hf_shapes",
    "files",
    "hf_shapes",
    "load_hf_into_stage",
    "open_safetensors_dir",
    "rebucket",
    "safetensors_stream",
    "state_dicts",
    "stream_hf_buckets",
    "write_hf",
]
