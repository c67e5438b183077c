# The two commands a new user needs: `make demo` and `make test`.
# TORCH_SPEC picks the torch build installed when the environment lacks torch. The default is the CPU wheel;
# a GPU user sets e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test lint

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Torch is installed only when missing, so an existing GPU build is never replaced by the CPU wheel.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e ".[$*]"
	touch $@

# The main job: a small language model with hand-sharded blocks (fsdp2) on 2 CPU processes.
demo: $(VENV)/.installed-test
	$(PY) examples/train_lm.py --devices 2 --flavour fsdp2

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
