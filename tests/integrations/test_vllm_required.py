"""`make test-vllm` fails, rather than skips, where vLLM is missing or broken (no vLLM needed:
a stand-in `vllm` package that raises on import is put first on the path)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_missing_vllm_fails_the_integration_run_when_required(tmp_path):
    """Mutation: the integration conftest's check removed (each module's importorskip then
    turns the missing vLLM into skips and the run exits 0). The stand-in raises what a
    missing vLLM, or one whose dependency is missing, raises (`ModuleNotFoundError`, which
    importorskip skips on): collecting tests/integrations with UBEP_REQUIRE_VLLM=1 must exit
    non-zero and name it."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'vllm' (stand-in)\", name='vllm')\n")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "UBEP_REQUIRE_VLLM": "1", "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only",
                           "-p", "no:cacheprovider", str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "No module named 'vllm' (stand-in)" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr


def test_make_test_vllm_requires_vllm_and_native():
    """Mutation: `UBEP_REQUIRE_VLLM=1` (or `UBEP_REQUIRE_NATIVE=1`) dropped from the
    `test-vllm` target: its pytest line must set both."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-vllm:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "no test-vllm target in the Makefile"
    runs = [line for line in recipe.group(1).splitlines() if "pytest" in line]
    assert runs and all("UBEP_REQUIRE_VLLM=1" in line and "UBEP_REQUIRE_NATIVE=1" in line
                        for line in runs), runs
