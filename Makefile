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
# more workers than cores pays, but each worker imports every test module (torch, Lightning) and
# starts its own zygote (tests/zygote.py): 3 on two cores. PYTEST_WORKERS=0 runs in this process.
# Each module runs on one worker (--dist loadscope), so a module fixture (a four-rank sharded save)
# is built once; modules go out in the order tests/conftest.py gives them, the longest first
# (--no-loadscope-reorder: xdist would otherwise start the modules with the most tests first, and
# the one-test modules that wait longest, last).
PYTEST_WORKERS ?= 3

test: $(STAMP)
	$(PY) -m pytest -q --timeout=180 -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

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
