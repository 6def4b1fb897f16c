# Two commands do all set-up: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test demo clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --upgrade pip
	# CPU torch from the on-disk wheel first: never let pip resolve a bare `torch` (CUDA build).
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	@$(BIN)/python -m pip install -q -e '.[dev]'
	# verl and OpenRLHF as data for tests/unit/test_frameworks.py (never imported): no dependencies.
	@$(BIN)/python -m pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q tests notebooks --nbmake

demo: install
	$(BIN)/nereus demo

clean:
	rm -rf $(VENV) build *.egg-info
