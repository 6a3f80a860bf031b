# `make test` and `make demo` work from a fresh clone: they build .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: demo test lint typecheck pytest bench system-deps clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

system-deps:
	@bash scripts/setup-system.sh

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check rehydrate tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy --strict rehydrate

pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest

test: lint typecheck pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
