# Two commands do all set-up on a fresh machine: `make demo` (the main job) and `make test`.
# torch is installed first and pinned (constraints.txt) in every step: an unpinned resolve
# would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= -m "not slow"

.PHONY: demo test test-fast test-all install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[cpu,test,bench,quality]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/cocodiff demo

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: PYTEST_ARGS = -m unit
test-fast: test

test-all: PYTEST_ARGS =
test-all: test

clean:
	rm -rf $(VENV) demo-output .pytest_cache
