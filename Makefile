# Two commands on a fresh machine: `make demo` and `make test`.
# torch is pinned and installed first: asking pip for the project alone could pull a multi-GB CUDA build.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all test-fast setup clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test,plot,hf]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# The runtime-schedule and rewrite-pass suites run on 8 ranks for tens of minutes on a 2-core
# machine; `make test-all` includes them.
SLOW := --ignore=tests/dist/test_runtime.py --ignore=tests/dist/test_passes.py

test: $(STAMP)
	$(PY) -m pytest -q tests $(SLOW)

test-all: $(STAMP)
	$(PY) -m pytest -q tests

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not dist"

clean:
	rm -rf $(VENV) *.egg-info
