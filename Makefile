# Everything set-up needs on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo bench clean

$(STAMP): setup.cfg pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --timeout=180 $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) demo-checkpoints .pytest_cache
