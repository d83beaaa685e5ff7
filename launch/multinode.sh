#!/usr/bin/env bash
# Multi-node with c10d rendezvous; run the same command on every node:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 launch/multinode.sh NPROC_PER_NODE RECIPE [key=value ...]
# RECIPE "none" uses the defaults plus the overrides.
# MASTER_ADDR/MASTER_PORT: the rendezvous endpoint (node 0). RDZV_ID: a job id shared by the nodes.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: NNODES=N NODE_RANK=R MASTER_ADDR=HOST $0 NPROC_PER_NODE RECIPE [key=value ...]" >&2; exit 2; fi
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
nproc=$1; recipe=$2; shift 2
exec torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$nproc" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-offgrpo}" \
  -m megatron_offgrpo.train $([ "$recipe" = none ] || echo --config "$recipe") "$@"
