# Two commands for a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
MODELS ?= models

.PHONY: install demo test lint typecheck check clean redis-server

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Everything: every extra and the test tools. torch is pinned first because its 2.13.0 CPU wheel
# is on local disk, while any other version pip might pick inside pyproject's range would pull a
# multi-GB CUDA build; with it installed, the range is satisfied and pip keeps it.
TORCH_PIN ?= torch==2.13.0

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q '$(TORCH_PIN)'
	$(BIN)/pip install -q -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fulcrum.demo --repository $(MODELS) --port $(PORT)

# The Redis cache tests start their own redis-server; this installs it where it is missing.
redis-server:
	bash scripts/redis-server.sh

# The Ray tests start a Ray cluster: scripts/ray-tests.sh runs them in a loopback-only network
# namespace (never on the host network), so the main run leaves them out.
test: $(STAMP) redis-server
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --ignore=tests/ray
	bash scripts/ray-tests.sh

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) $(MODELS) build *.egg-info
