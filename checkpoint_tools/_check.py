"""Is a HF model directory's weights what its config.json describes? Read from the safetensors headers alone (no
tensor data is loaded), before any process, model or engine is built."""

from __future__ import annotations

from pathlib import Path

from checkpoint_tools._io import CheckpointError, open_safetensors_dir
from checkpoint_tools._shapes import hf_shapes
from megatron_offgrpo.model import QwenArch


def hf_dir_errors(directory: str | Path, arch: QwenArch, limit: int = 3) -> list[str]:
    """What is wrong with the weights of ``directory`` for ``arch``: none, a truncated file (the data length its
    header declares against the file's size), tensors missing, or shapes other than the config's (at most ``limit``
    of each listed). Empty when they are complete and match."""
    directory = Path(directory)
    try:
        files = open_safetensors_dir(directory)
    except CheckpointError as exc:
        return [str(exc)]
    expected = hf_shapes(arch)
    missing = [name for name in expected if name not in files]
    errors = []
    if missing:
        more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
        errors.append(f"weights lack {missing[:limit]}{more} that its config.json describes")
    wrong = []
    for name, shape in expected.items():
        if name in files:
            got = files.shape(name)
            if got != shape:
                where = files.file_of(name).name
                wrong.append(f"{where}: {name} has shape {list(got)}, config.json gives {list(shape)}")
    if wrong:
        more = f"; and {len(wrong) - limit} more" if len(wrong) > limit else ""
        errors.append(f"weights do not match its config.json: {'; '.join(wrong[:limit])}{more}")
    return errors
