# Two commands matter: `make demo` and `make test`. Each sets itself up from a fresh clone.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The venv gets the core and every extra ([all]: lightning, report, transformers) plus
# the dev tools, so `make test` runs every integration's tests and `make demo` can plot.
# torch is pinned here (not in pyproject) so CI gets the CPU wheel that lies on this
# machine's disk; anywhere else pip fetches the same version from PyPI.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.9.0
# tests/trainers run flashwatch on torchtitan's and OLMo-core's own models in a venv of
# their own, .venv-trainers: ai2-olmo-core 3.0.0 needs cached-path, which holds
# huggingface_hub below 2 (it resolves 1.33, and rich below 14), while transformers 5 in
# .venv needs huggingface_hub 2.4 or later; one venv would downgrade it under transformers.
# torchtitan 0.3.0 imports triton without declaring it, hence TRITON_PIN there too.
# flashwatch goes in without extras ([transformers] would bring the clash back).
TVENV := .venv-trainers
TBIN := $(TVENV)/bin
TORCHTITAN_PIN ?= torchtitan==0.3.0
OLMO_CORE_PIN ?= ai2-olmo-core==3.0.0
PYTEST_PIN ?= pytest>=8
# tests/integrations/test_prometheus.py and tests/test_dashboards*.py run a real Prometheus server and
# promtool: Debian's package has both and installs without starting a daemon.
APT_INSTALL := apt-get install -y --no-install-recommends
PROMETHEUS_HINT := prometheus and promtool are missing; the Prometheus tests need them. \
Install Debian's package as root: sudo $(APT_INSTALL) prometheus (or run sudo make prometheus)

.PHONY: install install-trainers prometheus apt test demo lint bench clean

# Debian's python3 has no venv module until python3-venv is installed.
$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV) || { $(MAKE) --no-print-directory apt PKG=python3-venv \
		&& $(PY) -m venv $(VENV); }
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" -e ".[all,dev]"
	touch $@

install: $(BIN)/.installed

$(TBIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(TVENV) || { $(MAKE) --no-print-directory apt PKG=python3-venv \
		&& $(PY) -m venv $(TVENV); }
	$(TBIN)/pip install -q --upgrade pip
	$(TBIN)/pip install -q "$(TORCH_PIN)" "$(TRITON_PIN)" "$(TORCHTITAN_PIN)" "$(OLMO_CORE_PIN)" "$(PYTEST_PIN)" -e .
	touch $@

install-trainers: $(TBIN)/.installed

# Installs nothing when both are on PATH, so reruns cost nothing. Not root, or no
# apt-get: says what to run and goes on; the tests that need them fail with that hint.
prometheus:
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null; then :; \
	elif [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then \
		$(MAKE) --no-print-directory apt PKG=prometheus; \
	else echo "make: $(PROMETHEUS_HINT)" >&2; fi

# One Debian package, as root: `make apt PKG=...`.
apt:
	@[ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null || { \
		echo "make: Debian's $(PKG) package is needed; run: sudo $(APT_INSTALL) $(PKG)" >&2; \
		exit 1; }
	@echo "installing Debian's $(PKG) package with apt-get"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(APT_INSTALL) -qq $(PKG) >/dev/null

# The main suite, then tests/trainers in .venv-trainers (their conftest fails loudly
# where torchtitan or OLMo-core is missing, so the main suite leaves them out by name).
test: install install-trainers prometheus
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --ignore=tests/trainers
	$(TBIN)/python -m pytest -q tests/trainers

demo: install
	$(BIN)/flashwatch demo --out runs/demo
	$(BIN)/flashwatch report runs/demo

lint: install
	$(BIN)/ruff check .

bench: install
	$(BIN)/python benchmarks/bench_reference.py
	$(BIN)/python benchmarks/bias_lean.py

clean:
	rm -rf $(VENV) $(TVENV) build *.egg-info
