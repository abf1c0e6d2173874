# posttrain: one venv (.venv), pinned by requirements/lock.txt. torch is the local CPU wheel
# (pip's find-links on this machine kind); never let pip resolve an unpinned torch.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check -c requirements/lock.txt

.PHONY: setup test demo bench-odc bench-train bench-pipeline clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/lock.txt
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[test]"
	touch $@

test: setup
	$(PY) -m pytest -q

demo: setup
	$(PY) -m posttrain demo

bench-odc: setup
	$(PY) benchmarks/odc_transport.py

bench-train: setup
	$(PY) -m posttrain bench odc

bench-pipeline: setup
	$(PY) -m posttrain bench pipeline

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
