"""With `UBEP_REQUIRE_VLLM=1` (`make test-vllm` sets it) vLLM must import, or the run stops
before any test with the import's error: the modules' `importorskip("vllm")` (which lets the
main suite run without vLLM) cannot turn a missing or broken vLLM into skips there."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("UBEP_REQUIRE_VLLM") != "1":
        return
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to import is the run's failure
        raise pytest.UsageError(
            f"UBEP_REQUIRE_VLLM=1 (make test-vllm) but vLLM does not import: "
            f"{type(e).__name__}: {e}") from e
