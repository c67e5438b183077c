# The two commands a new user needs: `make demo` and `make test`.
# TORCH_SPEC picks the torch build installed when the environment lacks torch. The default is the CPU wheel;
# a GPU user sets e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test clients lint docs gpu-check install-check

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

# With CUDA, this includes the GPU suite (tests/gpu, marked `cuda`); without, those tests are skipped and say why.
# Three pytest-xdist workers, a test file each at a time (its module-scoped rank groups start once): the suite
# waits much of the time (process start-up, rendezvous, provoked timeouts), so three files fit on 2 cores.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Real Fabric programs run unchanged through torchloom's Fabric switch (tests/clients, marked `clients`): litgpt
# 0.5.13's pretrain and LoRA on a tiny model, one process against Lightning Fabric bit for bit, two processes
# under fsdp and fsdp2. Heavy (litgpt and its dependencies; 2:43 plus the install on a clean clone, 19 minutes on a loaded
# machine), so not in `make test`. They get an environment of their own (CLIENTS_VENV), so litgpt's pins
# (huggingface-hub, jsonargparse, psutil) never change the packages `make test` runs with.
CLIENTS_VENV ?= .venv-clients
clients:
	$(MAKE) VENV=$(CLIENTS_VENV) $(CLIENTS_VENV)/.installed-test,clients
	$(CLIENTS_VENV)/bin/python -m pytest -q -n 0 -m clients tests/clients

# The scenario engine's long run (tests/scenarios): a seeded random sample of user choices (strategy, layout,
# world size, optimizer, precision, accumulation, clipping, loop, checkpoint and resume), each judged against
# plain torch or the uninterrupted run; a markdown report (and .json beside it) goes to SCENARIO_REPORT.
# SCENARIO_SEED may list several seeds ("21 22 23": SCENARIO_COUNT scenarios each); SCENARIO_STRATEGY=pipeline
# draws one strategy's scenarios only.
SCENARIO_COUNT ?= 300
SCENARIO_SEED ?= 1
SCENARIO_STRATEGY ?=
SCENARIO_REPORT ?= scenario-report.md
.PHONY: scenarios
scenarios: $(VENV)/.installed-test
	$(PY) tests/scenarios/run_many.py --count $(SCENARIO_COUNT) --seed $(SCENARIO_SEED) \
		$(if $(SCENARIO_STRATEGY),--strategy $(SCENARIO_STRATEGY)) --report $(SCENARIO_REPORT)

# Fault tolerance's chaos run (tests/fault_tolerance/chaos.py): random kills of random replica groups every few
# steps (CHAOS_KILLS of them) for at least 100 committed steps, judged by the record's replay; a markdown report
# goes to CHAOS_REPORT. A few minutes (each kill restarts a process).
CHAOS_SEED ?= 1
CHAOS_KILLS ?= 12
CHAOS_REPORT ?= reports/ft-chaos.md
.PHONY: chaos
chaos: $(VENV)/.installed-test
	$(PY) tests/fault_tolerance/chaos.py --steps 100 --kills $(CHAOS_KILLS) --seed $(CHAOS_SEED) \
		--report $(CHAOS_REPORT)

# On a machine with a GPU (under 10 minutes): the CUDA tests, the step-overhead and memory benchmarks on CUDA, and
# a summary. It uses $(VENV) as it is, or creates it with TORCH_SPEC; without a GPU it stops with the reason.
gpu-check:
	VENV=$(VENV) TORCH_SPEC="$(TORCH_SPEC)" bash benchmarks/gpu_check.sh

# torchloom installed as a user installs it (a fresh environment, TORCH_SPEC, then the runtime dependencies only),
# then a 2-process job with both checkpoint formats: a runtime dependency that only the test extra brought fails
# here. A few minutes, most of it installing torch; .ci/run runs it after the suite.
install-check:
	PYTHON=$(PYTHON) TORCH_SPEC="$(TORCH_SPEC)" bash tests/install/install_check.sh

# The documentation site (docs/, mkdocs.yml) into site/, strictly: a broken link, a missing page or a docstring
# the API reference cannot read fails the build.
docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# ruff (rules and formatting), then mypy over the public API (the files and overrides are in pyproject.toml's
# [tool.mypy]). Every step runs; the target fails when any does.
lint: $(VENV)/.installed-dev
	status=0; \
	$(VENV)/bin/ruff check src tests examples || status=1; \
	$(VENV)/bin/ruff format --check src tests examples || status=1; \
	$(VENV)/bin/mypy || status=1; \
	exit $$status
