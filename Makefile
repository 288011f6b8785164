# Two commands do everything: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: test test-all test-slow demo demo-stop demo-distributed lint clean browser

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test,demo,distributed]'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

## browser: Debian's chromium + chromedriver for the UI test (installed once, with apt-get)
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q chromium chromium-driver >/dev/null; }; }

# Tests run in parallel (pytest-xdist), one process per core, at most 4: most of a test's time is
# spent waiting for the subprocesses it starts. Each test has its own files and database
# (a PostgreSQL database per worker). PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= auto
XDIST := -n $(PYTEST_WORKERS) --maxprocesses 4

## make test: set up .venv (and chromium) if needed, then run the test suite (SQLite and PostgreSQL)
test: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" $(XDIST) $(PYTEST_ARGS)

## make test-all: also the slow tests (end-to-end runs that a faster default test mirrors)
test-all: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

## make test-slow: only the slow tests (CI runs make test, then this)
test-slow: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow $(XDIST) $(PYTEST_ARGS)

## make demo: run the demo (see README)
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m airflow_elastic_gpu.demo

## make demo-distributed: PostgreSQL, CeleryExecutor (Redis), two workers, two triggerers, one killed mid-run (see docs/distributed.md)
demo-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m airflow_elastic_gpu.demo_distributed $(DEMO_ARGS)

demo-stop: $(STAMP)
	$(BIN)/python -m airflow_elastic_gpu.demo --stop

lint: $(STAMP)
	$(BIN)/pip install -q ruff && $(BIN)/ruff check airflow_elastic_gpu tests examples benchmarks

clean:
	rm -rf $(VENV) .demo .demo-distributed .pytest_cache .hypothesis
