# The two quick-start commands. Each does all set-up on a fresh machine (a virtualenv
# with the project, its test tools and the CPU inference stack), then its job.
#   make demo   - the main job on the embedded default (no Redis to install)
#   make test   - the whole test suite (unit, integration with real Redis and workers)
PYTHON ?= python3
# Where the CPU build of torch comes from: pip's configured sources unless set (on Linux,
# plain PyPI serves the multi-GB CUDA build; TORCH_INDEX=https://download.pytorch.org/whl/cpu
# gets the CPU one).
TORCH_INDEX ?=
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.sits-installed

.PHONY: demo test lint bench gpu-check gpu-wheels gpu-rehearse clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: the CPU build; the inference extra must not pull a CUDA one.
	# pip byte-compiles what it installs one file at a time (torch's thousands: half of the
	# set-up); compileall does it on every core. It must be done here: with
	# PYTHONDONTWRITEBYTECODE set (CI sets it) no import writes a .pyc, and every worker
	# process would compile torch again. Like pip's, it skips files that do not compile
	# (torch ships a Python 3.12-only test helper): they fail only if imported.
	$(BIN)/pip install --quiet --no-compile $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==2.13.0"
	$(BIN)/pip install --quiet --no-compile -e ".[dev,inference,otel]"
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/sitsq demo

# Three pytest processes by default, on CI's 2 cores: the integration tests spend most of
# their time waiting on worker subprocesses and Redis, so a second process nearly halves
# the wall time and a third takes off another quarter (2,222 tests, 2026-12-04: 519 s
# with two, 393-405 s with three, 361 s with four). Three, not four: three were also run
# with one of the two cores kept busy by another process (452 s, all passed); four were
# not, and put more processes on each core.
# Whole files go to one process (loadfile): a module's costly fixtures (a benchmark run,
# a worker) run once. Each process starts its own private redis-server.
# PYTEST_WORKERS=0 runs everything in this process. The 20 slowest tests are listed at
# the end, to keep the suite's time in view (CI allows 20 minutes).
PYTEST_WORKERS ?= 3
test: $(STAMP)
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=20

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/sitsq bench ab --json bench-ab.json
	$(BIN)/sitsq bench broker --json bench-broker.json
	$(BIN)/sitsq bench coldstart --json bench-coldstart.json

gpu-check:
	bash ops/gpu_check.sh

# On a machine with PyPI: what a bare GPU image lacks, as wheels in .whl to carry there.
gpu-wheels: $(STAMP)
	bash ops/gpu_wheels.sh

# ops/gpu_check.sh as the bare GPU host runs it (carried wheels, no redis-server), here.
gpu-rehearse: $(STAMP)
	bash ops/gpu_rehearse.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
