# Two commands do all the set-up on a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LINTED := isolate agent_shim tests examples bench tools

.PHONY: setup demo test mutate

# The package alone (anyio, pydantic, psutil): all the demo needs.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

# The dev tools on top, for the tests (Ray, mypy, hypothesis, ...).
$(VENV)/.dev-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(VENV)/.dev-installed

demo: $(VENV)/.installed
	$(BIN)/isolate demo

# pytest exits 5 when it collected nothing: for this suite that is a failure, not a pass.
test: setup
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy
	$(BIN)/python -m pytest; status=$$?; \
	if [ $$status -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

# Mutation testing (docs/testing.md): not part of make test, about an hour or more on 2 cores.
# MODULES=isolate/_core/system/env.py picks modules; MUTATE_ARGS=--show prints each survivor's diff.
MODULES ?=
MUTATE_ARGS ?=
mutate: setup
	$(BIN)/python tools/mutate.py $(MODULES) $(MUTATE_ARGS)
