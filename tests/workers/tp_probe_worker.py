"""torchrun worker: the trainer's refresh probe of an HF model at the TP size of this run (the world size), the
TP-gathered export the engine would receive and the derived probe bound; rank 0 writes OUT_JSON for the test.

It builds the policy exactly as `offgrpo train` does (``build_policy`` from model.hf_path, init=hf, fp32) and takes
the probe from ``train._trainer_side.probe_logprobs`` (what ``train._sync.verify`` compares the engine with).

Usage: torchrun --nproc_per_node TP tp_probe_worker.py HF_DIR OUT_JSON
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megatron_offgrpo.config import load_config
from megatron_offgrpo.model import load_arch
from megatron_offgrpo.rollout import probes
from megatron_offgrpo.runtime import init_parallel
from megatron_offgrpo.train._policy import build_policy
from megatron_offgrpo.train._trainer_side import logit_bound, probe_logprobs
from megatron_offgrpo.train._weights import export_buckets


def _export_vs_hf(exported: dict[str, torch.Tensor], hf_dir: Path) -> dict:
    """Which exported tensors differ from the HF files, bit for bit, and by how much."""
    from safetensors.torch import load_file

    hf: dict[str, torch.Tensor] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        hf.update(load_file(path))
    differ = {name: float((t.double() - hf[name].double()).abs().max()) for name, t in exported.items()
              if name in hf and not torch.equal(t, hf[name])}
    missing = sorted(set(hf) - set(exported) - {"lm_head.weight"})  # tied: the engine ties it itself
    return {"tensors": len(exported), "differ": differ, "missing": missing,
            "dtypes": sorted({str(t.dtype) for t in exported.values()})}


def main() -> None:
    hf_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    config = load_config(None, [f"model.hf_path={hf_dir}", "model.init=hf", "model.precision=fp32",
                                f"parallel.tp={tp}"])
    ctx = init_parallel(config.parallel.tp, config.parallel.pp, config.parallel.seed)
    arch = load_arch(hf_dir)
    policy = build_policy(arch, ctx, config.model, config.optim, 1)
    probe = probes.make_probe_ids(arch.vocab_size)
    logp = probe_logprobs(policy.model, ctx, probe)
    bound = probes.probe_bound(arch.vocab_size, arch.hidden_size, logit_bound(policy.model, ctx))
    exported = {name: t.clone() for bucket in export_buckets(policy.model, arch, ctx) for name, t in bucket}
    if ctx.rank == 0:
        export = _export_vs_hf(exported, hf_dir)
        out.write_text(json.dumps({"tp": tp, "probe": probe, "logp": logp, "bound": bound, "export": export}))


if __name__ == "__main__":
    from megatron_offgrpo.cli import end_process

    main()
    end_process(0)  # without the interpreter's teardown of torch, megatron-core and vLLM: seconds per process
