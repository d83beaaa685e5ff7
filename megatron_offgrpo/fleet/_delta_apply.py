"""The worker's side of a delta refresh: patch its own image of the served weights, every check first.

vLLM CPU repacks linear weights into its GEMM kernels' layout, so the served parameters cannot be read back as the HF
tensors a delta patches: a worker that takes deltas keeps its own HF-named image of the version it serves, in the
served dtype, on CPU (one copy of the model per worker: 0.5B in bf16, ~1 GB; a TP worker keeps the whole model, since
vLLM's loader cuts its shard from whole tensors). The image is taken from a full refresh that says deltas follow
(``DeltaSpec.base`` None), dropped by any other full refresh, an adapter refresh or a failed reload, and absent after
a restart: a delta then gets a refusal, and the trainer a full sync.

``patch`` checks everything before anything is served: the delta's base is the served version and the image's, the
dtype is the served one, the blobs are exactly the model's tensors, and each blob applies (``deltas.apply_in_place``:
base, size, body, finite values, the checksum of the patched tensor; a refusal restores the image). ``reload_set``
then widens the changed tensors to the vLLM modules they feed (q/k/v fuse into one module, gate/up into another, a
MoE layer's experts into two stacked weights): a module is reloaded whole, from the image, so no module ever mixes a
reloaded and a stale part, and the MoE repack sees every expert of a layer it packs.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from checkpoint_tools import Named
from megatron_offgrpo.transports import deltas

_MODULE = re.compile(r"^(model\.layers\.\d+\.(?:self_attn|mlp))\.")


def keep_image(tensors: Named, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Own copies of a full version's tensors in the served dtype (the transports' buffers do not outlive the call)."""
    return {name: t.detach().to("cpu", dtype, copy=True).contiguous() for name, t in tensors}


def patch(image: dict[str, torch.Tensor], image_version: int | None, current: int, blobs: Named,
          spec: deltas.DeltaSpec, dtype: torch.dtype) -> set[str]:
    """Patch ``image`` in place by the delta ``blobs``; returns the names of the tensors that changed. All or
    nothing: a blob refused after others applied writes their old elements back (in place: no second copy of the
    model, only of the elements that change).

    Raises:
        deltas.Refused: one line saying why this worker must get a full sync instead (``image`` as it was).
    """
    if not image:
        raise deltas.Refused("this worker holds no image of its weights (it restarted or joined, or its last full "
                             "refresh was not a delta-mode one)", "no image")
    if spec.base is None or spec.base != current or image_version != current:
        raise deltas.Refused(f"the delta applies onto version {spec.base}, this worker serves version {current} "
                             f"(image of version {image_version})", "base")
    if spec.dtype != deltas.dtype_name(dtype):
        raise deltas.Refused(f"the delta is in {spec.dtype}, this worker serves {deltas.dtype_name(dtype)}", "dtype")
    names = [n for n, _ in blobs]
    missing, unknown = sorted(set(image) - set(names)), sorted(set(names) - set(image))
    if missing or unknown or len(names) != len(set(names)):
        raise deltas.Refused(f"the delta must carry every tensor once: {len(missing)} missing (e.g. {missing[:2]}), "
                             f"{len(unknown)} unknown (e.g. {unknown[:2]})", "tensors")
    undo: dict[str, Callable[[], None]] = {}
    try:
        for name, blob in blobs:
            restore = deltas.apply_in_place(name, blob, image[name], current)
            if restore is not None:
                undo[name] = restore
    except deltas.Refused:
        for restore in undo.values():
            restore()
        raise
    return set(undo)


def module_of(name: str) -> str:
    """The vLLM module an HF tensor feeds (a decoder layer's attention or MLP), or the tensor itself."""
    match = _MODULE.match(name)
    return match.group(1) if match else name


def reload_set(image: dict[str, torch.Tensor], changed: set[str]) -> Named:
    """Every tensor of the modules the ``changed`` tensors feed, from the (patched) image, in the image's order."""
    touched = {module_of(n) for n in changed}
    return [(n, t) for n, t in image.items() if module_of(n) in touched]
