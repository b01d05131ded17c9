# Two commands for a fresh machine:
#   make tutorial   set up .venv, execute every notebook headless (results in runs/)
#   make test       set up .venv, run the unit tests and every notebook under nbval
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup tutorial test clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

tutorial: setup
	$(BIN)/python -m helpers.run_notebooks

test: setup
	$(BIN)/python -m pytest

clean:
	rm -rf runs
