# Two commands matter: `make demo` and `make test`. Each sets itself up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here (not in pyproject) so CI gets the CPU wheel that lies on this
# machine's disk; anywhere else pip fetches the same version from PyPI.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.9.0

.PHONY: install test demo lint bench clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" -e ".[dev]"
	touch $@

install: $(BIN)/.installed

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/flashwatch demo --out runs/demo
	$(BIN)/flashwatch report runs/demo

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/bench_reference.py
	$(BIN)/python benchmarks/bias_lean.py

clean:
	rm -rf $(VENV) build *.egg-info
