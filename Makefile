# One command each: `make test` sets everything up on a fresh clone and runs every check.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Re-install only when the pins change.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-12)
PROTOS := $(shell find protos -name '*.proto')
PROTO_OUT := core/strata/rpc/.generated

.PHONY: setup demo serve test lint typecheck imports pytest protos binaries crds clean

setup: $(STAMP) $(PROTO_OUT) binaries

# llama.cpp, the tests' CPU oracle, is built for any x86-64 with AVX2 rather than for this CPU's every feature: a
# machine that lists AMX but may not run it (a VM) died of an illegal instruction in its AMX tiles (2026-11-28).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

# The main job: the control plane with the fake GPU pool, the chart, a model applied from examples/, every Strata pod
# run as a local process, until Ctrl-C (DEMO_ARGS=--keep-logs keeps the cluster and pod logs). DEMO_MODEL picks the
# model: generated (random weights) or gemma3-270m (the real Gemma 3 270M file of the test extra); any other is refused.
DEMO_MODEL ?= generated
demo: setup
	$(BIN)/python -m strata_testbed.demo "--model=$(DEMO_MODEL)" $(DEMO_ARGS)

# The data plane alone: a generated demo model served on this machine (SERVE_ARGS to change it).
serve: $(STAMP) $(PROTO_OUT)
	$(BIN)/strata serve $(SERVE_ARGS)

protos: $(PROTO_OUT)
$(PROTO_OUT): $(PROTOS) $(STAMP)
	rm -rf core/strata/rpc
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=core --pyi_out=core --grpc_python_out=core $(PROTOS)
	touch $@

crds: $(STAMP)
	$(BIN)/python -m strata.operator.crd
	$(BIN)/python -m strata.operator.chart_values
	$(BIN)/python -m strata.operator.reference
	$(BIN)/python -m strata.gguf.architecture_docs

binaries:
	testbed/build-binaries.sh >/dev/null

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP) $(PROTO_OUT)
	$(BIN)/mypy core operator stage_worker gateway testbed tests

imports: $(STAMP) $(PROTO_OUT)
	$(BIN)/lint-imports

pytest: setup
	$(BIN)/pytest $(PYTEST_ARGS)

test: lint typecheck imports pytest

clean:
	rm -rf $(VENV) core/strata/rpc .pytest_cache .mypy_cache .ruff_cache
