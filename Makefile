# Two commands do everything: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: test test-all test-slow test-containers images podman demo demo-stop demo-distributed lint clean browser

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
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow and not containers" $(XDIST) $(PYTEST_ARGS)

## make test-all: also the slow tests (end-to-end runs that a faster default test mirrors); not the container tests
test-all: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not containers" $(XDIST) $(PYTEST_ARGS)

## make test-slow: only the slow tests (CI runs make test, then this)
test-slow: $(STAMP) browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "slow and not containers" $(XDIST) $(PYTEST_ARGS)

## podman: Debian's podman, runc (crun fails on hybrid cgroups), slirp4netns (the pods' network) and debootstrap (installed once, with apt-get)
PODMAN_PACKAGES := podman runc slirp4netns debootstrap
podman:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v slirp4netns >/dev/null && \
	  command -v debootstrap >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q $(PODMAN_PACKAGES) >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q $(PODMAN_PACKAGES) >/dev/null; }; }

## make images: build the base image (debootstrap, cached) and docker/'s agent and trainer images with podman
images: $(STAMP) podman
	$(BIN)/python containers/build_images.py $(IMAGES_ARGS)

## make test-containers: run a real training job as the generated pod with podman kube play (opt-in; needs make images)
test-containers: $(STAMP) images
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m containers tests/test_containers.py $(PYTEST_ARGS)

## make demo: run the demo (see README)
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m airflow_elastic_gpu.demo

## make demo-distributed: PostgreSQL, CeleryExecutor (Redis), two workers, two triggerers, one killed mid-run (see docs/distributed.md)
demo-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m airflow_elastic_gpu.demo_distributed $(DEMO_ARGS)

demo-stop:  # never installs first: there is nothing to stop without the environment
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m airflow_elastic_gpu.demo --stop; fi

lint: $(STAMP)
	$(BIN)/pip install -q ruff==0.17.6 && $(BIN)/ruff check airflow_elastic_gpu tests examples benchmarks

clean: demo-stop
	rm -rf $(VENV) .demo .demo-distributed .pytest_cache .hypothesis
