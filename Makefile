# Everything set-up needs on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test soak demo bench clean

$(STAMP): setup.cfg pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt -e .
	touch $(STAMP)

# Worker processes for `make test`: the tests mostly wait on daemon and trainer subprocesses, so
# more workers than cores pays; PYTEST_WORKERS=0 runs in this process. Each module runs on one
# worker (--dist loadscope), so a module fixture (a four-rank sharded save) is built once.
PYTEST_WORKERS ?= 4

test: $(STAMP)
	$(PY) -m pytest -q --timeout=180 -n $(PYTEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# Long fuzzing, load and leak runs (tests/soak is skipped by `make test`).
soak: $(STAMP)
	CKPTD_SOAK=1 $(PY) -m pytest -q -s --timeout=3600 tests/soak $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py

# Every benchmark case in its own process, then benchmarks/RESULTS.md (BENCH_ARGS=--smoke: seconds).
bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) demo-checkpoints .pytest_cache
