#!/usr/bin/env bash
# The whole GPU check in one command, under 8 minutes on one H100 or H200 (6.5 min on an H100, 2026-11-27): the
# training step at 8,192-token micro-batches (eager, compiled and CUDA-graphed layers: MFU, GPU-busy share, host
# syncs and where they happen) with the fused loss against torch, Liger and naive logits at N = 16,384 bf16, the
# graphed step at one 32,768-token micro-batch (the MFU goal's shape), LoRA (r = 16) against full fine-tuning's step
# and peak memory, then every GPU-marked test. Everything it
# writes lands in one folder (step/, step-32k/, lora/, pytest_gpu.txt).
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
show() { grep -E "^gpu_step:|^\| |Error" | grep -v "^|---"; }
# 3 warm-up steps: reduce-overhead records its CUDA graphs on the second and third calls. The fused weight-gradient
# variants (fused, graphed-fused) are left out: measured no faster eager and 2.4x slower compiled (README).
timeout 170 python3 benchmarks/gpu_step.py --profile --warmup 3 --variants eager,compiled,graphed \
    --out "$out/step" 2>&1 | tee "$out/step.log" | show || status=1
timeout 90 python3 benchmarks/gpu_step.py --profile --warmup 3 --samples 16 --micro-batches 1 --variants graphed \
    --loss-tokens 2048 --repeats 2 --out "$out/step-32k" 2>&1 | tee "$out/step-32k.log" | show || status=1
# LoRA against full fine-tuning at the same shape, each in its own process (peak memory: the allocator's, per process)
timeout 150 python3 benchmarks/lora.py --device cuda --seq 2048 --samples 4 --micro-batches 1 --variants full,lora-r16 \
    --out "$out/lora" 2>&1 | tee "$out/lora.log" | grep -E "^lora benchmark|^\| " || status=1
timeout 300 python3 -m pytest -m gpu -q -rfs --tb=short -p no:cacheprovider tests > "$out/pytest_gpu.txt" 2>&1 || status=1
grep -E "passed|failed|^FAILED|^SKIPPED|^E " "$out/pytest_gpu.txt" | head -30
exit $status
