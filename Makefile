# Two entry points (see README): `make train` and `make test`. Both create .venv on first use. `make gpu-check` runs
# the CUDA checks on a GPU node (docs/performance.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test gpu-check
setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) recipes/train.py $(ARGS)

# Two pytest-xdist workers (the reference machine's 2 cores); tests that share an expensive fixture carry an
# xdist_group mark so that one worker runs them. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

# On a GPU node: every CUDA test, the recipe on trainer=gpu, the GPU drill and the quick bench on device memory, under
# 8 minutes on one GPU, into gpu_check/gpu_report.{json,md} (scripts/gpu_check.py). Without a GPU it says so and exits
# 0; DRY=1 lists what it would run. The .venv's torch is the CPU build: on a GPU node pass PY=<a python with CUDA torch
# and this package's dependencies>, and the .venv is not built.
gpu-check: $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
	$(PY) scripts/gpu_check.py $(if $(DRY),--dry-run) $(ARGS)
