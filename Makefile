# Everything set-up needs on a fresh machine: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-torchtitan test-hf test-deepspeed test-nonumpy test-slurm soak demo bench clean

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

# The torchtitan integration (integrations/torchtitan.py) against torchtitan itself, in a venv of its own:
# torchtitan 0.3 pulls in 465 MB and 42 packages beyond .venv (requirements-torchtitan.txt says what was measured), which
# `make test` does without. tests/torchtitan/ is collected only here (`make test` skips that directory by name).
TT_VENV := .venv-torchtitan
TT_PY := $(TT_VENV)/bin/python
TT_STAMP := $(TT_VENV)/.installed

$(TT_STAMP): setup.cfg pyproject.toml requirements-dev.txt requirements-torchtitan.txt
	$(PYTHON) -m venv $(TT_VENV)
	$(TT_PY) -m pip install --quiet --disable-pip-version-check -r requirements-torchtitan.txt -e .
	touch $(TT_STAMP)

test-torchtitan: $(TT_STAMP)
	$(TT_PY) -m pytest -q --timeout=300 -n 0 tests/torchtitan $(PYTEST_ARGS)

# The Hugging Face integrations (integrations/hf.py: the Trainer; integrations/accelerate.py: accelerate's
# save_state/load_state) against transformers and accelerate themselves, in a venv of
# its own (.venv-hf): torch==2.13.0 (CPU), the test runner, transformers 5.25 and accelerate 1.16
# (requirements-hf.txt says what was measured). tests/hf/ is collected only here (`make test` skips that directory by
# name); its trainers are processes of their own (one, and two under torchrun or accelerate launch), so it runs in this process (no -n).
HF_VENV := .venv-hf
HF_PY := $(HF_VENV)/bin/python
HF_STAMP := $(HF_VENV)/.installed

$(HF_STAMP): setup.cfg pyproject.toml requirements-hf.txt
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_PY) -m pip install --quiet --disable-pip-version-check -r requirements-hf.txt -e .
	touch $(HF_STAMP)

test-hf: $(HF_STAMP)
	$(HF_PY) -m pytest -q --timeout=600 tests/hf $(PYTEST_ARGS)

# The DeepSpeed checkpoint engine (integrations/deepspeed.py) against DeepSpeed itself, in a venv of its own
# (.venv-deepspeed): torch==2.13.0 (CPU), the test runner and DeepSpeed 0.19.8 (requirements-deepspeed.txt says what
# was measured). tests/deepspeed/ is collected only here (`make test` skips that directory by name); its training runs
# are processes of their own under DeepSpeed's launcher (CPU accelerator, gloo), so it runs in this process (no -n).
DS_VENV := .venv-deepspeed
DS_PY := $(DS_VENV)/bin/python
DS_STAMP := $(DS_VENV)/.installed

$(DS_STAMP): setup.cfg pyproject.toml requirements-deepspeed.txt
	$(PYTHON) -m venv $(DS_VENV)
	$(DS_PY) -m pip install --quiet --disable-pip-version-check -r requirements-deepspeed.txt -e .
	touch $(DS_STAMP)

test-deepspeed: $(DS_STAMP)
	DS_ACCELERATOR=cpu $(DS_PY) -m pytest -q --timeout=900 tests/deepspeed $(PYTEST_ARGS)

# The client's saves and loads where numpy is not installed: ckptd requires none and torch runs without it, but
# torch's numpy bridge (Tensor.numpy(), torch.from_numpy) then raises, and `make test` cannot see a use of it
# (Lightning brings numpy into .venv). .venv-nonumpy holds torch, ckptd's own requirements and the test runner, their
# versions read from requirements-dev.txt (torch from pip's cache or the local wheel store: about a minute, once;
# torch itself, not torch-checkpointing, which requires numpy).
# tests/nonumpy/ checks that numpy is absent and runs every load path; NONUMPY_TESTS adds the client's save and load
# modules. tests/nonumpy/ is collected only here (`make test` skips that directory by name).
NN_VENV := .venv-nonumpy
NN_PY := $(NN_VENV)/bin/python
NN_STAMP := $(NN_VENV)/.installed
NONUMPY_TESTS := tests/nonumpy tests/test_save_roundtrip.py tests/test_loading.py tests/test_load_ranks.py \
	tests/test_sharded_replicated.py

$(NN_STAMP): setup.cfg pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(NN_VENV)
	$(NN_PY) -m pip install --quiet --disable-pip-version-check $$(grep -E '^(torch[=<>]|pytest)' requirements-dev.txt) -e .
	touch $(NN_STAMP)

test-nonumpy: $(NN_STAMP)
	$(NN_PY) -m pytest -q --timeout=300 -n 2 --dist loadscope $(NONUMPY_TESTS) $(PYTEST_ARGS)

# deploy/slurm/ (the prolog, epilog and task prolog, and example.sbatch) against a real Slurm: Debian's slurmctld,
# slurmd and slurm-client, installed here when missing (apt-get, as root: about 10 s and 20 MB), one slurmctld and
# four slurmd on this host, jobs submitted with sbatch (about a minute). tests/slurm/ is collected only here (`make
# test` skips that directory by name).
SLURM_PACKAGES := slurmctld slurmd slurm-client

test-slurm: $(STAMP)
	command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		$(SLURM_PACKAGES); }
	$(PY) -m pytest -q --timeout=600 -n 0 tests/slurm $(PYTEST_ARGS)

# Long fuzzing, load and leak runs (tests/soak is skipped by `make test`).
soak: $(STAMP)
	CKPTD_SOAK=1 $(PY) -m pytest -q -s --timeout=3600 tests/soak $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/demo.py

# Every benchmark case in its own process, then benchmarks/RESULTS.md (BENCH_ARGS=--smoke: seconds).
bench: $(STAMP)
	$(PY) -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(TT_VENV) $(HF_VENV) $(DS_VENV) $(NN_VENV) demo-checkpoints .pytest_cache
