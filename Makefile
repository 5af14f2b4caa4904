# Two commands for a fresh machine: `make demo` and `make test`. Each builds .venv itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# CPU builds for this kind of machine; on a GPU server: make CONSTRAINTS= install
CONSTRAINTS ?= constraints/cpu.txt
PYTEST_ARGS ?=
# `make test` runs test files on this many pytest-xdist workers (0: one process, no xdist).
TEST_WORKERS ?= 3

.PHONY: install demo test test-unit lint format bench bench-smoke clean gpu-wheels gpu-check

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "make install: gpuyard and its dependencies into $(VENV) (minutes on a fresh machine; pip names each package)"
	$(BIN)/python -m pip install --progress-bar on $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev,ray]'
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/gpuyard demo

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not bench" $(PYTEST_ARGS)

# Every benchmark script once in its --smoke mode, its last line checked (CI runs it after make test).
bench-smoke: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist load -m bench tests/integration/test_benchmarks_smoke.py $(PYTEST_ARGS)

# The unit tier alone (no processes, no servers): under a minute on 2 cores.
test-unit: $(STAMP)
	$(BIN)/python -m pytest -m unit tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy src/gpuyard

format: $(STAMP)
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

bench: $(STAMP)
	@for b in benchmarks/*.py; do echo "== $$b"; $(BIN)/python $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# The GPU acceptance path (docs/fabric.md). Here, with a registry: fetch the wheels the GPU image lacks.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_27_x86_64 --platform manylinux1_x86_64 -d wheels -r constraints/gpu-wheels.txt

# There, on the NVIDIA machine (its own PyTorch, no registry): tests, NVML, NCCL, calibration, MFU.
gpu-check:
	bash benchmarks/gpu_check.sh
