# Two commands for a fresh machine:
#   make tutorial   set up .venv, execute every notebook headless (results in runs/)
#   make test       set up .venv, run the unit tests and every notebook under nbval, twice in one kernel:
#                   in the precision the rule picks, then in the other one (tests/conftest.py)
#   make test-other-precision   the precision-dependent unit tests again, with the precision the rule did
#                   not pick forced through TUTORIAL_PRECISION (fp32 <-> bf16); skipped where that is bf16 on a CPU
#                   without bf16 instructions (emulated)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup tutorial test test-other-precision clean

setup: $(VENV)/.installed

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -r requirements.txt
	touch $@

tutorial: setup
	$(BIN)/python -m helpers.run_notebooks

test: setup
	$(BIN)/python -m pytest

test-other-precision: setup
	@if $(BIN)/python -c "from tests.passes import other_precision_emulated as e; raise SystemExit(not e())"; then \
		echo "skipped: the other precision is bf16, which this CPU emulates 13-30x slower (tests/passes.py)"; \
	else \
		other=$$($(BIN)/python -c "from tests.passes import other_precision; print(other_precision())") && \
		echo "forcing TUTORIAL_PRECISION=$$other" && \
		TUTORIAL_PRECISION=$$other $(BIN)/python -m pytest -m precision tests; \
	fi

clean:
	rm -rf runs
