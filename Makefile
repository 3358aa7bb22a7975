# BatchWeave developer commands. Needs only python3 (>= 3.11), node and npm.
#   make demo   - install into .venv and run the demo
#   make test   - install dev extras and Azurite, run the test suite
#                 (extra pytest arguments: make test PYTEST_ARGS='-k s3 -x')
#   make clean  - remove the venv, node_modules and generated files

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
AZURITE := node_modules/.bin/azurite-blob
PYTEST_ARGS ?=

.PHONY: venv dev demo test clean

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

$(AZURITE):
	if [ -f package-lock.json ]; then npm ci --no-audit --no-fund; \
	else npm install --no-audit --no-fund; fi

demo: venv
	$(VENV)/bin/batchweave demo

test: dev $(AZURITE)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) node_modules build dist src/*.egg-info .pytest_cache .hypothesis \
	       demo-data bench-out .test-services
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
