"""Is a HF model directory's weights what its config.json describes? Is a megatron dist checkpoint's every file
there and whole? Read from headers and metadata alone (no tensor data is loaded), before any process, model or engine
is built."""

from __future__ import annotations

import json
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
    expected = _with_classifier_head(hf_shapes(arch), directory, arch.hidden_size)
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


def _with_classifier_head(expected: dict[str, tuple[int, ...]], directory: Path,
                          hidden: int) -> dict[str, tuple[int, ...]]:
    """A sequence classifier's (``*ForSequenceClassification``: a reward model, served on a fleet) tensors: its
    ``score`` head [num_labels, H] stands where a causal LM's output layer is."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return expected  # the config's own check names it
    if not any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return expected
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)  # transformers' default: 2
    return {**{k: v for k, v in expected.items() if k != "lm_head.weight"}, "score.weight": (labels, hidden)}


DIST_METADATA = "metadata.json"  # megatron's: the backends of a dist checkpoint
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's: where each item of the state dict lies in which file


def dist_dir_errors(directory: str | Path) -> list[str]:
    """What keeps the megatron dist checkpoint at ``directory`` from loading, read from its metadata alone: megatron's
    ``metadata.json`` or torch's ``.metadata`` unreadable, a ``*.distcp`` file the metadata names missing, or shorter
    than the bytes the metadata places in it (a copy cut short). Empty when every file is there and long enough;
    a flipped bit inside a file is only found by the load itself."""
    directory = Path(directory)
    try:
        backends = json.loads((directory / DIST_METADATA).read_text())
        if not isinstance(backends, dict) or "sharded_backend" not in backends:
            raise ValueError("no sharded_backend")
    except (OSError, ValueError) as exc:
        return [f"{directory / DIST_METADATA}: unreadable or corrupt ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}): copy the checkpoint again"]
    if backends["sharded_backend"] != "torch_dist":
        return []  # another backend's layout: megatron's load names what it misses
    return _distcp_errors(directory)


def _distcp_errors(directory: Path) -> list[str]:
    """The ``*.distcp`` files torch's ``.metadata`` names: each present and at least as long as its items' end."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
        ends: dict[str, int] = {}
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    except Exception as exc:  # noqa: BLE001 - an unpickling of damaged bytes raises anything
        lines = str(exc).strip().splitlines()
        return [f"{directory / DCP_METADATA}: unreadable or corrupt ({type(exc).__name__}"
                f"{': ' + lines[0][:200] if lines else ''}): copy the checkpoint again"]
    errors = []
    for name, end in sorted(ends.items()):
        path = directory / name
        if not path.is_file():
            errors.append(f"{path}: missing (the checkpoint's {DCP_METADATA} places {end} bytes in it)")
        elif (size := path.stat().st_size) < end:
            errors.append(f"{path}: truncated: {size} bytes, its {DCP_METADATA} places {end} in it")
    return [f"{error}: copy the checkpoint again" for error in errors[:3]] + (
        [f"and {len(errors) - 3} more files"] if len(errors) > 3 else [])
