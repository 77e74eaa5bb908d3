# Every target creates the virtual environment from a fresh clone when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs lint bench doctor clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,docs]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m xla_permute demo

test: $(STAMP)
	$(BIN)/python -m pytest

docs: $(STAMP)
	$(BIN)/sphinx-build -T -n -W --keep-going -b html docs docs/_build/html

lint: $(STAMP)
	$(BIN)/ruff check src tests conftest.py docs/conf.py
	$(BIN)/ruff format --check src tests conftest.py docs/conf.py

bench: $(STAMP)
	$(BIN)/python -m xla_permute bench

doctor: $(STAMP)
	$(BIN)/python -m xla_permute doctor

clean:
	rm -rf docs/_build docs/jupyter_execute .pytest_cache
