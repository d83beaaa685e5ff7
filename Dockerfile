# syntax=docker/dockerfile:1
# megatron-offgrpo: one image for both roles, the trainer (megatron-core, Transformer Engine) and the vLLM fleet.
#
# Base: NVIDIA's PyTorch container, written against nvcr.io/nvidia/pytorch:25.12-py3 (its release notes: PyTorch
# 2.10.0a0+b4e4ee81d3, CUDA 13.1, Python 3.12). It ships Transformer Engine and apex built for its own torch: the
# trainer's TE layer spec, the FP8 recipes and megatron's fused optimizers need them, and neither installs
# reliably from PyPI on top of another torch. TE must lie in the range of the project's `te` extra, which is the
# range megatron-core 0.16.1 (the newest the registry serves) declares for itself (its `dev` extra:
# transformer-engine>=2.9.0a0,<2.12.0); launch/check_image.py verifies that at build time and stops the build if not.
# So the base moves with megatron-core: a newer release of this container, with a TE of 2.12 or later, needs the
# megatron-core that supports it (BASE_IMAGE below is a build argument; check_image.py says which TE it found).
# Not yet built on NVIDIA's base or run on a GPU. Built with podman on a stand-in base (Debian, a venv with the CPU
# torch as `python`: Dockerfile.cpu's torch-standin stage) by `launch/build_image.sh --gpu-standin`, which passes when
# every step succeeds up to launch/check_image.py and that check fails naming Transformer Engine and apex.
#
# Two Python environments, because vLLM and the container each need their own torch:
#   * the system python (trainer) keeps the container's torch, TE and apex. Every pip install into it runs under
#     /opt/offgrpo/keep.txt, a constraints file that pins the container's torch stack to the installed builds
#     (on top of NVIDIA's own /etc/pip/constraint.txt), so pip fails instead of replacing them; check_image.py
#     then compares torch's version with the one recorded before the first install.
#   * /opt/vllm (fleet) is a venv with vLLM's released wheel and the torch it pins: vLLM's compiled kernels fit one
#     torch build (vLLM's install docs say to build from source to use another), and the rollout side never
#     imports megatron, so the fleet needs nothing from the container's stack. `offgrpo fleet start` runs its
#     servers with this interpreter ($OFFGRPO_FLEET_PYTHON). The disk weight transport needs no shared torch; the
#     collective one joins the two torch builds over gloo (not yet measured across them).
#
# Build (network to nvcr.io and PyPI):
#   docker build -t megatron-offgrpo:0.1.0 .
# Run (GPUs through the NVIDIA container toolkit; mount the models and a run directory):
#   docker run --gpus all --ipc=host -v $PWD/runs:/workspace/megatron-offgrpo/runs megatron-offgrpo:0.1.0 offgrpo train --config configs/qwen2.5-0.5b-gsm8k.yaml
#   docker run --gpus all --ipc=host megatron-offgrpo:0.1.0 torchrun --nproc_per_node 8 -m megatron_offgrpo.train --config configs/qwen2.5-0.5b-gsm8k.yaml
#   docker run --gpus all --ipc=host --network host -e OFFGRPO_FLEET_TOKEN -v /models:/models megatron-offgrpo:0.1.0 offgrpo fleet start --model /models/Qwen2.5-0.5B-Instruct --max-model-len 1024 --host 0.0.0.0 --foreground --state-dir runs/fleet
#   docker run --gpus all megatron-offgrpo:0.1.0 python benchmarks/gpu_step.py --out runs/gpu-step
#   docker run --gpus all megatron-offgrpo:0.1.0 python launch/check_image.py --torch-version-file /opt/offgrpo/torch-version --gpu
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

# The fleet's vLLM: the version the worker extension (megatron_offgrpo/fleet/_worker_ext.py) was tested with.
ARG VLLM_VERSION=0.32.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    OFFGRPO_FLEET_PYTHON=/opt/vllm/bin/python

# Record the container's torch stack before anything can touch it.
RUN mkdir -p /opt/offgrpo \
 && python -c "import torch; print(torch.__version__)" > /opt/offgrpo/torch-version \
 && python -m pip list --format=freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine[-_a-z0-9]*|apex|flash[-_]attn|nvidia-[a-z0-9-]+)==' \
    > /opt/offgrpo/keep.txt \
 && grep -iq '^torch==' /opt/offgrpo/keep.txt

# The fleet environment first (the slow layer, independent of the project's code): vLLM and its own torch.
# NVIDIA's pip configuration pins the container's torch; this venv must not see it.
RUN python -m venv /opt/vllm \
 && env -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null /opt/vllm/bin/python -m pip install "vllm==${VLLM_VERSION}"

WORKDIR /workspace/megatron-offgrpo
COPY pyproject.toml setup.py README.md LICENSE ./
COPY megatron_offgrpo ./megatron_offgrpo
COPY checkpoint_tools ./checkpoint_tools

# The trainer environment: the project (editable, so a mounted checkout at this path is what runs) on the
# container's torch, which the constraints keep, with tensorboard, the trackers (wandb, mlflow) and the report's plots.
RUN python -m pip install --constraint /opt/offgrpo/keep.txt -e ".[trainer,plot,tensorboard,tracking]"
# The fleet environment: the project with its vllm extra (already satisfied by the wheel above), without megatron-core
# (the trainer extra), which the fleet never imports.
RUN env -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null /opt/vllm/bin/python -m pip install -e ".[vllm]" \
 && /opt/vllm/bin/python -c "import vllm, megatron_offgrpo.fleet; print('fleet env: vllm', vllm.__version__)"

COPY configs ./configs
COPY launch ./launch
COPY benchmarks ./benchmarks
COPY docs ./docs
RUN python launch/check_image.py --torch-version-file /opt/offgrpo/torch-version

# NVIDIA's entrypoint prints the container banner, sets up the CUDA compatibility libraries and then runs the
# command it is given, so `docker run IMAGE offgrpo train ...` and `docker run IMAGE offgrpo fleet ...` both work.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
CMD ["offgrpo", "--help"]
