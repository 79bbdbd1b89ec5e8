# Everything runs inside .venv, created and filled on first use (make demo / make test).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pytest workers: the CI machine has 2 cores
JOBS ?= 2

.PHONY: venv demo test test-fast coverage bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,hf]'
	@touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(PY) examples/demo.py

test: venv
	$(PY) -m pytest -q -n $(JOBS) --dist loadgroup tests

coverage: venv
	$(PY) -m torchtpu_export.coverage --regenerate

bench: venv
	@if [ -f benchmarks/run.py ]; then $(PY) benchmarks/run.py; fi
	$(PY) benchmarks/litert_vs_litert_torch.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
