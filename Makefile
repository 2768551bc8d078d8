# Two commands for a fresh machine:
#   make run    -- ask the built-in model (the trained tiny DeepSeek-V4.1) a question it learnt to answer
#   make test   -- run the test suite
# Both create .venv and install what they need from the hashed lock, requirements/dev.lock (docs/DEPENDENCIES.md):
#   1. the lock, --require-hashes --no-deps: every package at its locked version and sha256, pip included;
#   2. torch, pinned (TORCH_SPEC) and kept out of the lock: on these machines pip's configuration serves
#      torch==2.13.0 as a local CPU wheel whose sha256 is not PyPI's, elsewhere it is PyPI's CUDA 13 build (an
#      unpinned torch would pull a multi-GB CUDA build here too). Its own dependencies are already in place from
#      the lock, so this adds torch alone (and, off these machines, the nvidia-* wheels that torch pins exactly);
#   3. dsv41 itself, editable, --no-deps --no-build-isolation (built with the lock's setuptools and wheel);
#   4. pip check: the installed set is consistent.
# `make lock` regenerates the lock (uv pip compile; LOCK_ARGS="--upgrade" or "--upgrade-package NAME" to move pins).
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
# a fact of the tiny model's made-up atlas (docs/TINY_MODEL.md); PROMPT=... asks anything else
PROMPT  ?= What is the capital of Olvello?
# keep equal to nix/python/wheels.nix's torch pin (tests/test_pins.py checks)
TORCH_SPEC ?= torch==2.13.0
LOCK    ?= requirements/dev.lock

$(BIN)/.installed: pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip check
	touch $@

.PHONY: install run test lock train-tiny
install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/dsv41 generate --chat --think --prompt "$(PROMPT)" --max-tokens 64

# Train the tiny model on a GPU (docs/TINY_MODEL.md): TRAIN_OUT is the run folder, continued by the next call;
# each call stops, checkpointed, within TRAIN_CALL_MINUTES; the export lands in TRAIN_OUT/model when done.
TRAIN_OUT          ?= runs/tiny
TRAIN_MINUTES      ?= 16
TRAIN_CALL_MINUTES ?= 9
TRAIN_ARGS         ?=
train-tiny: $(BIN)/.installed
	$(BIN)/dsv41 train-tiny --out $(TRAIN_OUT) --total-minutes $(TRAIN_MINUTES) --max-minutes $(TRAIN_CALL_MINUTES) $(TRAIN_ARGS)

# TEST_WORKERS=N runs the suite on N processes (pytest-xdist, from requirements/dev.in), whole files per worker
# (--dist loadfile: each module-scoped fixture, several of which build tiny checkpoints, is made once), handed out
# in collection order (--no-loadscope-reorder: tests/conftest.py puts the longest files first, xdist would
# otherwise order files by their number of tests). Two, the default, for the 2-core CI machine: a fresh clone's
# suite took 16 min 3 s on two workers against 23 min 13 s serially (1403 passed); 12 min 45 s on two
# workers at 6287452 (1450 passed), 22 min 29 s for the same suite on a CI machine under load; 13 min 16 s at
# 194d58a (1470 passed), 14 min 44 s at d25b3f5 (1471: + an interpreted 64 s test), 14 min 25 s at 1fbdb04
# (1509 passed; the project's CI machine took 29-37 min for the same suite), 16 min 56 s after the
# issue 31-35 merges of 2026-12-06 (1,680 tests, 250 skipped). TEST_WORKERS=0 runs serially. The 30 slowest tests are listed at the end (to keep LONGEST_FILES current).
TEST_WORKERS ?= 2

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

# The lock: pyproject.toml's dependencies with its serve and test extras, plus requirements/dev.in, for CPython 3.11
# on Linux, against the flake's pins (requirements/nix-pins.txt, written from nix/python/wheels.nix), with every
# file's sha256 from PyPI. Compiled for x86_64 and checked to name the same versions on aarch64 (one lock serves
# both; the two differ only in markers that pip evaluates). uv runs from its own venv under build/; the lock's
# existing pins are kept unless LOCK_ARGS says otherwise (uv reads the output file as its preferences).
UV_VERSION ?= 0.13.9
LOCK_VENV  ?= build/lock-venv
LOCK_ARGS  ?=
UV_COMPILE  = $(LOCK_VENV)/bin/uv pip compile --quiet --config-file requirements/uv.toml \
              pyproject.toml requirements/dev.in --extra serve --extra test \
              --constraint requirements/nix-pins.txt --no-emit-package torch \
              --python-version 3.11 --generate-hashes --custom-compile-command "make lock" $(LOCK_ARGS)

lock:
	test -x $(LOCK_VENV)/bin/uv && $(LOCK_VENV)/bin/uv --version | grep -qF " $(UV_VERSION)" || \
	  { $(PY) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q "uv==$(UV_VERSION)"; }
	mkdir -p build
	$(PY) requirements/nix_pins.py > requirements/nix-pins.txt
	$(UV_COMPILE) --python-platform x86_64-manylinux_2_28 --output-file $(LOCK)
	cp $(LOCK) build/dev-aarch64.lock
	$(UV_COMPILE) --python-platform aarch64-manylinux_2_28 --output-file build/dev-aarch64.lock
	grep -oE '^[A-Za-z0-9._-]+==[^ ;\\]+' $(LOCK) > build/pins-x86_64.txt
	grep -oE '^[A-Za-z0-9._-]+==[^ ;\\]+' build/dev-aarch64.lock > build/pins-aarch64.txt
	diff build/pins-x86_64.txt build/pins-aarch64.txt || \
	  { echo "make lock: x86_64 and aarch64 resolve differently; split the lock per platform" >&2; exit 1; }
	@echo "$(LOCK): $$(wc -l < build/pins-x86_64.txt) packages, the same on x86_64 and aarch64"
