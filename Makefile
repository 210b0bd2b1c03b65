# `make demo` runs the main job, `make test` the test suite; both create or reuse a Python 3.12
# virtualenv at $(VENV) and install the pinned stack into it.
VENV ?= .venv
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ps-bridge-installed

.PHONY: venv demo test test-all clean-venv

venv: $(STAMP)

$(STAMP): requirements.txt requirements-nodeps.txt requirements-dev.txt requirements-verl.txt requirements-verl-nodeps.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or run 'make PYTHON312=/path/to/python3.12'"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q -r requirements-verl.txt
	$(PY) -m pip install -q --no-deps -r requirements-verl-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/ps-bridge demo

# the default suite (CI): tests marked `slow` (most multi-rank cases) are left to `make test-all`
test: venv
	$(PY) -m pytest -q -ra -m "not slow"

test-all: venv
	$(PY) -m pytest -q -ra

clean-venv:
	rm -rf $(VENV)
