#!/usr/bin/env bash
# Build the CPU container image (trainer + vLLM CPU fleet + the project) with podman, from a local Debian base.
#
#   launch/build_image.sh [--dry-run]                 the base (once), then the CPU image (Dockerfile.cpu)
#   launch/build_image.sh --base-only [--dry-run]     only the base image
#   launch/build_image.sh --gpu-standin [--dry-run]   ./Dockerfile on a stand-in base (Debian + python + the CPU
#                                                     torch): exits 0 when every step passes up to its last,
#                                                     launch/check_image.py, and that one fails naming what only
#                                                     NVIDIA's image has (Transformer Engine, apex); else 1
#   launch/build_image.sh --help
#
# Steps (--dry-run prints them and runs nothing):
#   1. podman settings: CONTAINERS_CONF=launch/containers.conf (runc, cgroupfs, open-file and process limits).
#   2. base, skipped when the image exists: debootstrap --variant=minbase bookworm (python3, python3-venv,
#      ca-certificates) from this machine's apt mirror; the machine's extra CA certificates copied in and
#      update-ca-certificates run in a chroot (HTTPS from a container may be re-signed by a local CA); podman import.
#   3. the CPU torch wheel copied into the build context (.image-wheels/, ignored by git): a build sees nothing else.
#   4. podman build: Dockerfile.cpu (its `cpu` stage runs `make setup`), or the stand-in then ./Dockerfile.
# Prerequisites (root, Debian): apt-get install -y podman buildah debootstrap runc
# Environment: IMAGE (megatron-offgrpo:0.1.0-cpu), BASE (localhost/offgrpo-debian:bookworm),
#   TORCH_WHEEL (/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl), MIRROR (apt's Debian URI),
#   STANDIN (localhost/offgrpo-torch-standin:bookworm), GPU_IMAGE (megatron-offgrpo:0.1.0-standin).
# Measured on 2 cores (docs/benchmarks.md, "Container image"): base 45 s, CPU image 4 min, --gpu-standin 5 min.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${IMAGE:-megatron-offgrpo:0.1.0-cpu}"
BASE="${BASE:-localhost/offgrpo-debian:bookworm}"
STANDIN="${STANDIN:-localhost/offgrpo-torch-standin:bookworm}"
GPU_IMAGE="${GPU_IMAGE:-megatron-offgrpo:0.1.0-standin}"
TORCH_WHEEL="${TORCH_WHEEL:-/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl}"
WHEELS="$ROOT/.image-wheels"
export CONTAINERS_CONF="$ROOT/launch/containers.conf"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }

DRY_RUN=0 MODE=cpu
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --base-only) MODE=base ;;
    --gpu-standin) MODE=gpu-standin ;;
    -h|--help) usage; exit 0 ;;
    *) echo "build_image.sh: unknown argument $arg" >&2; usage >&2; exit 2 ;;
  esac
done

# The URI of this machine's Debian sources (deb822 or one-line format); deb.debian.org when none is found.
mirror() {
  local uri
  uri="$(grep -hsE '^URIs:' /etc/apt/sources.list.d/*.sources | grep -v security | head -1 | awk '{print $2}')"
  [[ -n "$uri" ]] || uri="$(grep -hsE '^deb ' /etc/apt/sources.list | grep -v security | head -1 | awk '{print $2}')"
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${MIRROR:-$(mirror)}"

step() { echo "+ $*"; [[ $DRY_RUN == 1 ]] || "$@"; }
timed() {  # a step with its wall time and exit status
  local start=$SECONDS rc=0
  step "$@" || rc=$?
  [[ $DRY_RUN == 1 ]] || echo "build_image.sh: $(( SECONDS - start )) s (exit $rc): $*"
  return $rc
}

make_base() {
  if [[ $DRY_RUN == 0 ]] && podman image exists "$BASE"; then
    echo "build_image.sh: base $BASE exists, kept (podman rmi $BASE to make it again)"
    return
  fi
  [[ $DRY_RUN == 1 ]] && echo "# skipped when podman image exists $BASE"
  local rootfs=/var/tmp/offgrpo-rootfs.XXXXXX
  [[ $DRY_RUN == 1 ]] || rootfs="$(mktemp -d /var/tmp/offgrpo-rootfs.XXXXXX)"
  timed debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR"
  step find /usr/local/share/ca-certificates -name '*.crt' -exec cp -t "$rootfs/usr/local/share/ca-certificates" {} +
  step chroot "$rootfs" update-ca-certificates
  step bash -c "rm -rf '$rootfs'/var/cache/apt/archives/*.deb '$rootfs'/var/lib/apt/lists/*"
  timed bash -c "tar -C '$rootfs' --numeric-owner -c . | podman import --change 'CMD=[\"/bin/bash\"]' - '$BASE'"
  step rm -rf "$rootfs"
}

stage_wheel() {
  step mkdir -p "$WHEELS"
  step cp -u "$TORCH_WHEEL" "$WHEELS/"
}

make_base
[[ $MODE == base ]] && exit 0
stage_wheel
cd "$ROOT"
WHEEL_NAME="$(basename "$TORCH_WHEEL")"
if [[ $MODE == cpu ]]; then
  timed podman build -f Dockerfile.cpu --target cpu --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_WHEEL="$WHEEL_NAME" -t "$IMAGE" .
  [[ $DRY_RUN == 1 ]] || podman image ls "$IMAGE"
else
  timed podman build -f Dockerfile.cpu --target torch-standin --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH_WHEEL="$WHEEL_NAME" -t "$STANDIN" .
  # ./Dockerfile must stop at its last RUN, launch/check_image.py, naming what only NVIDIA's image has; a failure
  # anywhere before it (a broken install step) or a check that passes is an error of this script. --layers=false:
  # one working container, committed only at the end, which the check never reaches (it grew the disk by 18 GB);
  # with layers, committing the vLLM venv's layer (vLLM's CUDA wheels) ran out of the 42 GB that were free.
  log=/dev/null
  [[ $DRY_RUN == 1 ]] || log="$(mktemp /var/tmp/offgrpo-standin-build.XXXXXX)"
  set +e
  timed podman build --layers=false -f Dockerfile --build-arg BASE_IMAGE="$STANDIN" -t "$GPU_IMAGE" . 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  [[ $DRY_RUN == 1 ]] && exit 0
  last_step="$(grep -E '^STEP [0-9]+/[0-9]+: ' "$log" | tail -1)"
  if [[ $rc != 0 && "$last_step" == *"RUN python launch/check_image.py"* ]] \
     && grep -q 'check_image: Transformer Engine is not installed' "$log" \
     && grep -q 'check_image: apex is not installed' "$log"; then
    echo "build_image.sh: the stand-in build passed every step of Dockerfile up to its check, which named:"
    grep '^check_image: ' "$log" | sed 's/^/  /'
    rm -f "$log"
    exit 0
  fi
  echo "build_image.sh: the stand-in build did not stop at launch/check_image.py as expected (exit $rc, last" \
       "step: ${last_step:-none}); log: $log" >&2
  exit 1
fi
