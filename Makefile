# posttrain: one venv (.venv), pinned by requirements/lock.txt. torch is the local CPU wheel
# (pip's find-links on this machine kind); never let pip resolve an unpinned torch.
# Targets are named after the commands they run: `make bench-odc` runs `posttrain bench odc`.
VENV ?= .venv
PY := $(VENV)/bin/python
# Bytecode: pip does not compile at install (--no-compile: the packages' every module, a minute
# here, most never imported); the interpreters make and cache it for what they import, the first
# time. So make's commands write bytecode even where the environment says not to (this machine
# kind sets PYTHONDONTWRITEBYTECODE=1: with that and --no-compile every interpreter compiled its
# imports anew, and the full tier took 18 min instead of 13).
export PYTHONDONTWRITEBYTECODE :=
PIP := $(PY) -m pip install -q --disable-pip-version-check --no-compile -c requirements/lock.txt
BENCHES := odc rl rl-e2e transport overhead balance pipeline pipeline-dp lora

.PHONY: setup test test-fast test-full test-torch-compat lint demo results gpu-check clean $(addprefix bench-,$(BENCHES))

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/lock.txt
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	touch $@

# Two tiers (tests/conftest.py): the fast one (single process, under a minute) and the full one.
# `make test` runs both in one pytest over TEST_WORKERS worker processes (pytest-xdist): on 2 cores
# the full tier's tests leave a core idle about 40% of the time (starting processes, waiting on
# peers), so 2 workers took it from 12-13 min to about 8. Tests sharing an expensive module fixture
# carry an xdist_group mark and run in one worker (--dist loadgroup), so it is built once (on pytest
# 9.2 through tests/conftest.py: xdist 3.8's own grouping no longer takes there); tests marked slow
# are collected first, so that no worker ends the run on one while the other idles.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup
test: setup lint
	$(PY) -m pytest -q $(XDIST)

test-fast: setup lint
	$(PY) -m pytest -q -m "not full"

test-full: setup
	$(PY) -m pytest -q -m full $(XDIST)

# A second torch (docs/torch.md): the tests that read FSDP2's and pipelining's internals, under the
# CUDA build of torch 2.14.1 that this machine kind keeps on disk (about 5.5 GB; runs on the CPU).
TORCH_COMPAT ?= 2.14.1
COMPAT_VENV ?= .venv-torch$(TORCH_COMPAT)
COMPAT_TESTS := tests/test_odc_parity.py tests/test_odc_protocol.py tests/test_dp_engines.py tests/test_odc_flat.py \
	tests/test_pipeline_runtime.py tests/test_pipeline_schedules.py tests/test_layout.py

$(COMPAT_VENV)/.installed: pyproject.toml requirements/lock.txt
	python3 -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==$(TORCH_COMPAT)
	grep -v '^torch==' requirements/lock.txt > $(COMPAT_VENV)/lock.txt
	$(COMPAT_VENV)/bin/python -m pip install -q --disable-pip-version-check -c $(COMPAT_VENV)/lock.txt -e ".[test]"
	touch $@

test-torch-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS)

lint: setup
	$(VENV)/bin/ruff check src tests examples scripts

# ARGS passes options through: `make demo ARGS="--json out/demo.json"` (posttrain demo --help).
ARGS ?=
demo: setup
	$(PY) -m posttrain demo $(ARGS)

$(addprefix bench-,$(BENCHES)): bench-%: setup
	$(PY) -m posttrain bench $*

results: setup
	$(PY) -m posttrain results

# On a GPU machine: the CUDA tests and measurements, written to out/gpu-report.md.
gpu-check: setup
	$(PY) -m posttrain doctor

clean:
	rm -rf $(VENV) $(COMPAT_VENV) out .pytest_cache .hypothesis
