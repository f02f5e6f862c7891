# kvgate: two commands set everything up. `make demo` and `make test` each create
# their own virtual environment on first use and reuse it afterwards.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM lives in its own environment (it pins its own fastapi/transformers/pydantic);
# kept outside the work tree so clones on one machine share it.
KVGATE_CACHE ?= $(HOME)/.cache/kvgate
VLLM_VENV ?= $(KVGATE_CACHE)/vllm-venv
export KVGATE_CACHE VLLM_VENV

.PHONY: demo test test-fast bench redis vllm-env wheel clean

$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[bench]'
	touch $@

$(VENV)/.test-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(VENV)/.demo-installed $@

# DEMO_ARGS: options for `kvgate demo` (the tests pass a short slice: DEMO_ARGS="--duration 20").
DEMO_ARGS ?=
demo: $(VENV)/.demo-installed
	$(VENV)/bin/kvgate demo $(DEMO_ARGS)

redis:
	@command -v redis-server >/dev/null 2>&1 || tests/support/install-redis.sh

vllm-env:
	tests/support/vllm-env.sh "$(VLLM_VENV)"

test: $(VENV)/.test-installed redis vllm-env
	$(PY) -m pytest -ra

# Everything but the real-vLLM end-to-end tests (for a quick loop while developing).
test-fast: $(VENV)/.test-installed redis
	$(PY) -m pytest -ra -m "not vllm"

bench: $(VENV)/.test-installed redis
	$(PY) -m bench.run_all

# kvgate's wheel, for vLLM's image (its KV connector, cache_tier.connector): install it there with
# `pip install --no-deps` (vLLM keeps its own pinned packages) and `pip install xxhash`. kvgate is not on
# PyPI: this file is the package. DIST: where it goes.
DIST ?= dist
wheel: $(VENV)/.demo-installed
	$(PY) -m pip wheel -q --no-deps --no-build-isolation --wheel-dir $(DIST) .
	@ls $(DIST)/kvgate-*.whl

clean:
	rm -rf $(VENV) .pytest_cache
