#!/usr/bin/env bash
# Single node: launch/torchrun.sh NPROC RECIPE [key=value ...]
#   e.g. launch/torchrun.sh 4 configs/qwen2.5-0.5b-gsm8k.yaml parallel.tp=2
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 NPROC RECIPE [key=value ...]" >&2; exit 2; fi
nproc=$1; recipe=$2; shift 2
exec torchrun --standalone --nproc_per_node "$nproc" -m megatron_offgrpo.train --config "$recipe" "$@"
