#!/usr/bin/env bash
# The whole GPU check in one command, under 8 minutes on one H100 or H200: the training step (eager, fused
# weight-gradient accumulation, compiled and CUDA-graphed layers: MFU, GPU-busy share, host syncs and where they
# happen), the fused loss against torch, Liger and naive logits at N = 16,384 bf16, then every GPU-marked test.
# Everything it writes lands in one folder.
#
#   bash benchmarks/gpu_check.sh runs/gpu-check
#
# Wheels the machine lacks (megatron-core, liger-kernel) are installed first from ./.whl/ when that folder holds any
# (fetch them with `pip download --no-deps -d .whl megatron-core==0.16.1 liger-kernel==0.8.5`); they go into the
# interpreter itself, not a --target folder, since the tests start workers that set their own PYTHONPATH.
set -uo pipefail
out=${1:-runs/gpu-check}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L || exit 2
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0
# 3 warm-up steps: reduce-overhead records its CUDA graphs on the second and third calls.
timeout 360 python3 benchmarks/gpu_step.py --profile --warmup 3 --out "$out" 2>&1 | tee "$out/gpu_step.log" \
    | grep -E "^gpu_step:|^\| |Error" | grep -v "^|---" || status=1
timeout 240 python3 -m pytest -m gpu -q -rfs --tb=short -p no:cacheprovider tests > "$out/pytest_gpu.txt" 2>&1 || status=1
grep -E "passed|failed|^FAILED|^SKIPPED|^E " "$out/pytest_gpu.txt" | head -30
exit $status
