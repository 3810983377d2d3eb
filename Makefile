# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint install clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a CPU wheel of 2.13.0 lies on disk; any other spec downloads gigabytes.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ubep demo

lint: $(STAMP)
	$(BIN)/ruff check src tests

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q tests
	@leftover=$$(ls /dev/shm | grep -i ubep || true); \
	if [ -n "$$leftover" ]; then echo "leaked shared memory: $$leftover"; exit 1; fi

clean:
	rm -rf $(VENV) build *.egg-info
