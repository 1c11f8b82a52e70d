# Two entry points (see README): `make train` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test
setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) recipes/train.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)
