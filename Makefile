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
	# [test]: x-transformers and HF transformers, so the peer-equality tests run instead of skipping
	$(BIN)/pip install -q -e '.[dev,test]'

# the main job: nope, alibi, rope, sinusoidal char LMs on a generated corpus, scored at 1x-8x the training
# length: one table, one figure and a "did not learn" line (~2 min on 2 cores; experiment=ablation: the task)
run: setup
	$(BIN)/posformer-train -m experiment=extrapolation

# everything, in two passes: the tests make test-fast runs, then the slow ones (subprocesses, DDP,
# kill-and-resume, whole training runs), each pass on both cores (two pytest-xdist workers of one thread
# each: 2026-12-08 the fast pass took 3.4 min, the slow pass 8.2 min); the exit status fails if either failed
test: setup
	@status=0; \
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n 2 || status=1; \
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow -n 2 || status=1; \
	exit $$status

# the edit loop, 3.4 min on 2 cores (two pytest-xdist workers, one thread each; 2026-12-08): the
# suite without the `slow` tests (subprocesses, DDP,
# kill-and-resume, multiruns, torch.compile, whole training and benchmark runs, and the per-PE grids past a
# representative case); CI runs `make test`. HF_*_OFFLINE: no test needs the hub, and without it
# test_translation's hub test waits ~23 s on network timeouts once test_data has imported `datasets`
test-fast: setup
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n 2

# ruff (lint and formatting), then the layers and the no-cycle contracts of pyproject.toml's [tool.importlinter] (import-linter)
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check posformer scripts tests
	$(BIN)/lint-imports

bench: setup
	$(BIN)/python scripts/bench.py

clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
