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

# The single-process tiers (unit, planning) run on TEST_WORKERS pytest-xdist workers; the
# multi-rank tier on its own, since its pools of gloo ranks already take every core.
TEST_WORKERS ?= 2

# Every tier: unit, planning, and the 8-rank gloo tests (about 28 minutes on two cores).
test: test-fast
	$(PY) -m pytest -q tests -m dist

test-all: test

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) tests -m "not dist"

clean:
	rm -rf $(VENV) *.egg-info
