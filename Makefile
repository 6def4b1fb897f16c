# Two commands do all set-up: `make demo` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: install install-run test demo clean

install: $(STAMP)

install-run: $(RUN_STAMP)

# What `nereus demo` (and every command) needs: the package and its run-time dependencies.
# --no-compile: pip byte-compiles every file it installs (all of torch, scipy, pandas), about half
# of the install's time; instead one process imports every nereus module with bytecode writing on,
# so exactly what the project imports is compiled (docs/demo.md, "Time").
$(RUN_STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# CPU torch from the on-disk wheel first: never let pip resolve a bare `torch` (CUDA build).
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q --no-compile torch==2.13.0
	@$(BIN)/python -m pip install -q --no-compile -e .
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "$$COMPILE_IMPORTS"
	@touch $(RUN_STAMP)

# every nereus module (and so every library it imports at module level); test-only ones may be absent
define COMPILE_IMPORTS
import importlib, pkgutil, nereus
for m in pkgutil.walk_packages(nereus.__path__, "nereus."):
    try:
        importlib.import_module(m.name)
    except Exception:
        pass
endef
export COMPILE_IMPORTS

# The tests' extras on top (pytest, notebooks, transformers for the HF executor tests).
$(STAMP): $(RUN_STAMP)
	@$(BIN)/python -m pip install -q -e '.[dev]'
	# verl and OpenRLHF as data for tests/unit/test_frameworks.py (never imported): no dependencies.
	@$(BIN)/python -m pip install -q --no-deps verl==0.9.1 openrlhf==0.11.2
	# install-run compiled only what nereus imports; the tests import more of torch (checkpoint,
	# testing, distributed tools), and with PYTHONDONTWRITEBYTECODE set each process would recompile it
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q -j 0 $$($(BIN)/python -c "import torch, os; print(os.path.dirname(torch.__file__))") > /dev/null || true
	@touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q -n 2 tests notebooks --nbmake

# the demo needs no test extras: a fresh clone's `make demo` installs only what it runs
demo: install-run
	$(BIN)/nereus demo

clean:
	rm -rf $(VENV) build *.egg-info
