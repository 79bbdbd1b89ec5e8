# Everything runs inside .venv, created and filled on first use (make demo / make test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest workers: the CI machine has 2 cores
JOBS ?= 2

.PHONY: venv web-deps demo test test-fast coverage bench clean

# tools/qnn_libs.py: the test suite's Qualcomm NPU compiler libraries, from the onnxruntime-qnn wheel
$(STAMP): pyproject.toml tools/qnn_libs.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,hf,tpu,litertlm,serve]'
	$(PY) -m tools.qnn_libs
	@touch $(STAMP)

venv: $(STAMP)

demo: venv
	cd examples && $(abspath $(PY)) demo.py

# The browser tests (tests/web/test_litert_js.py) need Debian's chromium, node and examples/web's npm packages.
# Installed here when missing; if that fails make goes on and those tests fail saying what is missing.
WEB := examples/web
CHROMIUM ?= /usr/bin/chromium

web-deps:
	@command -v node >/dev/null && command -v npm >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; } || \
	  echo "web-deps: could not install node and npm; tests/web/test_litert_js.py will fail"
	@test -x $(CHROMIUM) || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } || \
	  echo "web-deps: could not install chromium; tests/web/test_litert_js.py will fail"
	@test $(WEB)/node_modules/.package-lock.json -nt $(WEB)/package-lock.json || \
	  (cd $(WEB) && npm ci --no-audit --no-fund --loglevel=error) || \
	  echo "web-deps: npm ci failed in $(WEB); tests/web/test_litert_js.py will fail"

test: venv web-deps
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup --durations=30 tests

# the committed coverage files (docs/coverage.*, tests/coverage_expected.json, the totals in docs/op-coverage.md);
# OPS='aten.add.*' regenerates those ops' rows only
coverage: venv
	$(PY) -m tools.coverage $(if $(OPS),--ops '$(OPS)')

bench: venv web-deps
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
