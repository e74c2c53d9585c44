SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.DEFAULT_GOAL := help
MAKEFLAGS += --no-builtin-rules

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; a machine with its own torch (a GPU image) can skip `install` and
# `pip install -e .` into its environment instead.
TORCH_SPEC ?= torch==2.13.0
PROTO_SRC := proto/weightwire/v1/weight_transfer.proto
PROTOC = $(PY) -m grpc_tools.protoc -I proto --plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc

help: ## Show this help
	@grep -hE '^[a-zA-Z0-9_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-14s\033[0m %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,dev]"
	@touch $@

install: $(VENV)/.installed ## Create .venv and install weightwire with test and dev extras (idempotent)

# SGLang's real model classes, parallel state and plugin registry on CPU, for tests/sglang. sglang's
# own requirements pull a CUDA torch and GPU kernels, so it goes in with --no-deps plus the few
# packages its LLM code imports, all under constraints that keep the CPU torch.
SGLANG_REQS := tests/sglang/requirements-cpu.txt
SGLANG_CONSTRAINTS := tests/sglang/constraints-cpu.txt
$(VENV)/.sglang-installed: $(SGLANG_REQS) $(SGLANG_CONSTRAINTS) | $(VENV)/.installed
	$(PIP) install -q -c $(SGLANG_CONSTRAINTS) --no-deps sglang==0.5.23 torchvision==0.28.0 compressed-tensors==0.18.0
	$(PIP) install -q --no-warn-conflicts -c $(SGLANG_CONSTRAINTS) -r $(SGLANG_REQS)
	@touch $@

install-sglang: $(VENV)/.sglang-installed ## Add SGLang 0.5.23 (CPU test stack, ~1.6 GB) to .venv (idempotent)

proto: install ## Regenerate the checked-in stubs from $(PROTO_SRC)
	$(PROTOC) --python_out=proto --pyi_out=proto --grpc_python_out=proto --mypy_grpc_out=proto $(PROTO_SRC)

checkproto: install ## Regenerate the stubs in a temp dir and fail if the checked-in ones differ
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PROTOC) --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp --mypy_grpc_out=$$tmp $(PROTO_SRC) >/dev/null; \
	for f in $$tmp/weightwire/v1/*; do \
	  diff -u "proto/weightwire/v1/$$(basename $$f)" "$$f" || { echo "generated code drifted: run 'make proto'"; exit 1; }; \
	done; echo "generated code is fresh"

lint: install ## ruff over the sources (generated code excluded)
	$(VENV)/bin/ruff check .

typecheck: install ## mypy over the packages
	$(VENV)/bin/mypy core server client adapters

test: install install-sglang ## Run the CPU test suite (what CI runs)
	$(PY) -m pytest -q

test-sglang: install install-sglang ## Run only the SGLang adapter tests (CPU, SGLang's real classes)
	$(PY) -m pytest -q -m sglang tests/sglang

test-gpu: ## Run the GPU suite on a CUDA machine (current python, not .venv; tests/gpu/run_suite.sh also installs and records the hardware)
	$(PYTHON) -m pytest -q -m "gpu or gpu2 or gpu4 or gpu8" -p no:cacheprovider tests/gpu

smoke: install ## Start a real worker on TCP loopback and check it with grpcurl
	$(PY) tests/smoke/run_smoke.py

demo: install ## Run the TP=2 x PP=2 demo on CPU: workers, pushes, verification, a refused mismatch
	$(VENV)/bin/weightwire demo

bench-cpu: install ## Host shared-memory path vs memcpy, and scaling over workers (BENCH_ARGS=... for more)
	$(PY) bench/bench_cpu.py $(BENCH_ARGS)

bench-gpu: ## On a CUDA machine: weightwire vs the copy limit and peer approaches (uses python3, like test-gpu)
	bench/run_gpu.sh $(or $(BENCH_OUT),bench/results/gpu-run) $(BENCH_ARGS)

bench-report: install ## Tables of the committed benchmark results, and the plots (bench/*.png)
	$(PIP) install -q -e ".[bench]"
	$(PY) bench/report.py --plots

clean: ## Remove build outputs (keeps .venv)
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache

.PHONY: help install install-sglang test-sglang proto checkproto lint typecheck test test-gpu smoke demo bench-cpu bench-gpu bench-report clean
