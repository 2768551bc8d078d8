# Two commands for a fresh machine:
#   make run    -- generate text with the built-in tiny model
#   make test   -- run the test suite
# Both create .venv and install what they need, torch first and pinned: on these machines pip's configuration
# serves torch==2.13.0 as the CPU wheel from local disk (an unpinned torch would pull a multi-GB CUDA build).
PY      ?= python3
VENV    ?= .venv
BIN      = $(VENV)/bin
PROMPT  ?= The quick brown fox
TORCH_SPEC ?= torch==2.13.0

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[serve,test]"
	touch $@

.PHONY: install run test
install: $(BIN)/.installed

run: $(BIN)/.installed
	$(BIN)/dsv41 generate --prompt "$(PROMPT)" --max-tokens 32

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)
