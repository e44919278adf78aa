# Every target sets up what it needs from nothing: a fresh clone and Python 3.11 with pip.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NOTEBOOKS := build/notebooks
NBMAKE := --nbmake --nbmake-timeout=600

# Eight emulated CPU devices, set before JAX starts (entry points also set jax_num_cpu_devices).
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
export PYTHONHASHSEED = 0

.PHONY: help demo test test-fast lint notebooks notebook-files bench clean chromium

help:  ## List the targets.
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)  ## Auto-parallelise a GPT-style Flax model on 8 emulated CPU devices.
	$(PY) examples/gpt_semi_auto.py

# The report tests open plan reports in a real headless browser: Debian's chromium package.
chromium:  ## Install Chromium (apt, as root) when it is missing; the report tests drive it.
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  { echo "installing chromium (report tests)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# The suite compiles many programs and runs each a step or two: XLA:CPU's LLVM back end
# at -O0 (tests/util.py FAST_COMPILE_FLAGS; the processes the tests start get it too). The HLO
# passes, the SPMD partitioner, buffer assignment and so the collectives, layouts and
# memory_analysis() the tests check are -O2's (checked on a GPT step: the same optimised HLO,
# memory and loss); only the machine code is less optimised, and every comparison in a test is
# between programs compiled alike. `make demo`, `make bench` and users keep XLA's default.
TEST_XLA_FLAGS = $(XLA_FLAGS) --xla_backend_optimization_level=0

# The notebooks run in the suite's pytest session, collected first: the two workers share them
# out with the tests from the start instead of running them one by one after the suite's tail.
test: $(STAMP) chromium  ## Run the whole suite: lint, types, unit tests, doctests, examples and notebooks.
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(MAKE) --no-print-directory notebook-files
	JAXPAR_REQUIRE_BROWSER=1 XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -n 2 --timeout=900 --durations=25 \
	  $(NBMAKE) --doctest-modules $(NOTEBOOKS) jaxpar tests

test-fast: $(STAMP)  ## The suite without the slow tests.
	XLA_FLAGS="$(TEST_XLA_FLAGS)" $(PY) -m pytest -n 2 -m "not slow" tests

lint: $(STAMP)  ## Static checks: ruff, and mypy for types (configured in pyproject.toml).
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

notebooks: notebook-files  ## Execute every notebook (jupytext .md sources) with nbmake.
	$(PY) -m pytest -p no:cacheprovider $(NBMAKE) $(NOTEBOOKS)

# The .ipynb files nbmake runs, made afresh from the .md sources (none left from a removed one).
notebook-files: $(STAMP)
	rm -rf $(NOTEBOOKS)
	mkdir -p $(NOTEBOOKS)
	for nb in notebooks/*.md; do \
	  $(VENV)/bin/jupytext --quiet --to ipynb -o $(NOTEBOOKS)/$$(basename $$nb .md).ipynb $$nb || exit 1; \
	done

$(VENV)/.bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) -m pip install --quiet --no-deps "keras-hub>=0.32,<0.33"  # see pyproject's bench extra
	touch $(VENV)/.bench

bench: $(VENV)/.bench  ## Measure plans, the zoo and the clock; writes bench/results/*.json and *.md.
	$(PY) bench/run.py

clean:  ## Remove the environment and build outputs.
	rm -rf $(VENV) build bench/results
