# EdgeLoop: the two commands are `make demo` and `make test`.
# Set-up is idempotent: a stamp file records the hash of pyproject.toml, so a
# second run spends seconds, not minutes.

PYTHON_BOOT ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
PIP         := $(PY) -m pip --disable-pip-version-check -q
# The CPU build of torch; pip finds it on this machine's disk instead of downloading GBs.
TORCH_PIN   ?= torch==2.13.0
STAMP_RUN   := $(VENV)/.installed-run
STAMP_DEV   := $(VENV)/.installed-dev
PYTEST_ARGS ?=
DEMO_ARGS   ?=
BENCH_ARGS  ?=

.PHONY: demo test bench docs gpu-check lint venv install install-dev system-deps clean help

help:
	@echo "make demo   - run the loop on embedded defaults (embedded broker, SQLite, local folders)"
	@echo "make test   - install what tests need and run them"
	@echo "make bench  - run the benchmark suite; results under bench/results/"
	@echo "make docs   - regenerate docs/performance.md from bench/results/"
	@echo "make lint   - ruff and mypy"

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

$(STAMP_RUN): pyproject.toml | $(PY)
	$(PIP) install "$(TORCH_PIN)"
	$(PIP) install -e .
	@touch $@

$(STAMP_DEV): pyproject.toml $(STAMP_RUN)
	$(PIP) install -e ".[dev]"
	@touch $@

venv: $(PY)
install: $(STAMP_RUN)
install-dev: $(STAMP_DEV)

# System packages the tests use: a Mosquitto the outage tests start and stop
# themselves, and Debian's Chromium + ChromeDriver for the review UI's browser
# tests. Installed only when missing and only when running as root; otherwise
# those tests skip with the reason.
system-deps:
	@missing=""; \
	command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || missing="$$missing mosquitto"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	command -v chromedriver >/dev/null 2>&1 || missing="$$missing chromium-driver"; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing system packages:$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null) \
			|| echo "warning: could not install$$missing; tests that need them fall back or skip"; \
	fi

demo: install
	$(VENV)/bin/edgeloop demo $(DEMO_ARGS)

# The layer contracts (.importlinter) first: a broken layer or an import cycle fails
# in seconds, before the suite runs.
test: install-dev system-deps
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install-dev
	$(PY) -m bench.run $(BENCH_ARGS)
	$(VENV)/bin/$(shell $(PY) -c "from bench.report import PROJECTION_COMMAND as c; print(c)") \
		> bench/results/simulations/projection.json.tmp
	mv bench/results/simulations/projection.json.tmp bench/results/simulations/projection.json

# docs/performance.md is rendered from bench/results/, never typed (a test checks it).
docs: install
	$(PY) -m bench.report

# On a GPU machine: the gpu extra from .whl/, GPU tests and benchmarks, within 8 minutes;
# results under gpu-check-results/.
gpu-check:
	bash scripts/gpu-check.sh

lint: install-dev
	$(VENV)/bin/lint-imports
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy shared edge_agent cloud_service distill kernels simulations

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
