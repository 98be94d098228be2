# Two commands on a fresh machine with only Python and make:
#   make demo   - the console over an embedded PostgreSQL, with workers and a live workload
#   make test   - the whole test suite (embedded PostgreSQL unless QCONSOLE_TEST_DSN is set)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench screenshots clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/qconsole demo

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check worker_core qconsole tests bench
	$(BIN)/mypy

bench:
	bash bench/run.sh $(BENCH_ARGS)

screenshots: $(STAMP)
	$(BIN)/python scripts/screenshots.py

clean:
	rm -rf $(VENV) .pytest_cache
