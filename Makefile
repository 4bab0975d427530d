# Two commands do everything (see README):  `make demo`  and  `make test`.
# Both create .venv on first use (CPU-only torch pinned in pyproject) and reinstall when pyproject changes.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: help demo test lint bench clean system-deps
.DEFAULT_GOAL := help

help:
	@echo 'make demo   - set up .venv and run servepilot demo (simulated engine + sidecar + load); ARGS="--duration 60"'
	@echo 'make test   - set up .venv, system packages and the real CPU engines (cached), run every test (ARGS="-k name")'
	@echo 'make lint   - ruff, import layers, mypy --strict on every package'
	@echo 'make bench  - print the tick benchmark figures'

system-deps:
	bash scripts/system-deps.sh

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[ml,plot,dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/servepilot demo $(ARGS)

test: $(STAMP)
	bash scripts/system-deps.sh
	bash scripts/engines.sh
	$(BIN)/pytest $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy detectors policies agent simulator dashboards

bench: $(STAMP)
	$(BIN)/python bench/tick.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
