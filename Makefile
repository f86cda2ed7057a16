# posformer: the two commands of the README are `make run` and `make test`; both set up first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

setup: $(BIN)/python
	# torch first, pinned to the CPU build on this machine; the package's range is then satisfied.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'

# the main job: rope vs alibi vs nope on the built-in task, one comparison table + figure (~3 min on 2 cores)
run: setup
	$(BIN)/posformer-train -m experiment=ablation

test: setup
	$(BIN)/python -m pytest

# the suite without the slow tests (subprocesses, DDP, kill-and-resume, multiruns); CI runs `make test`
test-fast: setup
	$(BIN)/python -m pytest -m "not slow"

lint:
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python scripts/bench.py

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
