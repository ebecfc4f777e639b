# Two entry points for a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Test modules run side by side in one process per core (at most 4): most of a cold run is
# single-threaded XLA and numba compilation. XDIST="" runs them in one process.
XDIST ?= --numprocesses=auto --maxprocesses=4 --dist=loadscope --no-loadscope-reorder
# Extra flags for `make run`, e.g. RUN_ARGS="--config.rl.max_seconds=120".
RUN_ARGS ?=

.PHONY: run test test-slow install install-test clean protos

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[test]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# The main job on the embedded default.
run: $(VENV)/.installed
	$(VENV)/bin/rlax-ps local --config=configs/rl_local.py --workdir=runs/rl_local $(RUN_ARGS)

# The default test suite (CPU only, fast); `make test-slow` adds the slow ones.
test: $(VENV)/.installed-test
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -m slow $(XDIST) $(PYTEST_ARGS)

# Regenerate the committed gRPC code after editing param_server/protos/param_server.proto.
protos: $(VENV)/.installed-test
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. param_server/protos/param_server.proto

clean:
	rm -rf $(VENV) runs build *.egg-info
