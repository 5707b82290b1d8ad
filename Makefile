# The two commands a newcomer needs (README): `make demo` and `make test`.
# Each creates .venv/ on first use and installs the project with its extras into it.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.demo-installed

.PHONY: demo test lint servers docker clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all]'
	touch $(STAMP)

# `make demo` installs what the default demo needs, no more (no PySpark: `twopc demo --spark`
# says how to add it); `make test` installs everything.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[demo]'
	touch $(DEMO_STAMP)

servers:
	tools/ensure-servers.sh

# The engine and local images for the fixtures' testcontainers path (README); exit 3 is
# "this machine cannot have an engine": the rest of the suite runs and that test says why it skips.
docker: servers
	tools/ensure-docker.sh || [ $$? -eq 3 ]

demo: $(DEMO_STAMP) servers
	$(BIN)/twopc demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check coordinator resource_managers messaging spark_integration twopc_demo
	$(BIN)/mypy
	$(BIN)/python tools/check_layering.py

# two test processes (pytest-xdist) by default, four at most: the suite waits on subprocesses,
# fsyncs and servers more than it computes, so two workers halve it on a 2-core machine
TEST_WORKERS ?= auto

test: lint servers docker
	$(BIN)/python -m pytest --numprocesses=$(TEST_WORKERS) --maxprocesses=4

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
