# Two commands do all set-up on a fresh machine: `make run` and `make test`.
# Each creates (or refreshes, when pyproject.toml changed) the virtual environment in .venv.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/default.yaml
ARGS   ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` (one per core of CI's 2; 1.29x over one process on a clean clone,
# bench/NOTES.md session 31): the multi-process tests (`multihost`) then run alone, after them, since
# under load they can miss their own deadlines. 0: one process.
TEST_WORKERS ?= 2

.PHONY: env run test test-all lint format bench plan rpeg clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

env: $(STAMP)

run: $(STAMP)  ## train with the built-in default config (GRPO on the tiny model, CPU-sized)
	$(PY) launch/multihost.py --config $(CONFIG) $(ARGS)

test: lint  ## the default test run (what CI runs): ruff, then everything but `slow` and `gpu`
	rc=0; $(PY) -m pytest -q -m "not slow and not gpu and not multihost" -n $(TEST_WORKERS) --dist loadfile \
	  $(PYTEST_ARGS) || rc=$$?; \
	rc2=0; $(PY) -m pytest -q -m "multihost and not slow and not gpu" $(PYTEST_ARGS) || rc2=$$?; \
	if [ $$rc -eq 5 ] && [ $$rc2 -eq 5 ]; then exit 5; fi; \
	[ $$rc -eq 0 -o $$rc -eq 5 ] && [ $$rc2 -eq 0 -o $$rc2 -eq 5 ]

lint: $(STAMP)  ## ruff: lint and format check (configured in pyproject.toml)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)  ## apply ruff's fixes and formatting
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

rpeg: $(STAMP)  ## any rpeg command without activating the venv: make rpeg ARGS="plan --config configs/p1.yaml"
	$(VENV)/bin/rpeg $(ARGS)

plan: $(STAMP)
	$(PY) -m rpeg_jax.cli plan --config $(CONFIG) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
