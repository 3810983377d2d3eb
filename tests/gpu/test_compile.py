"""The kernels compile for a GPU (sm_90) on this CPU-only host, with the lowering they rely on.

The interpreter runs Python, so it accepts code the Triton compiler rejects; this compiles
for real (Triton's bundled ptxas, no GPU needed) and checks the PTX: rows move as 16-byte
vectors (window rows read past L1), flags are set with release exchanges and polled with
acquire atomics (gpu scope), as many as the kernels have polls; and the Triton IR: every load
of a word another program of the same kernel wrote (counts, rows, weights, (token, slot)
words) bypasses L1 (`.cg`), which PTX confirms for the scalar words.
Whether a program's barrier precedes its release cannot be read off PTX text order (loops
are laid out out of order); that ordering is `tl.debug_barrier()` in the source.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="ubep.gpu needs triton (pip install 'ubep[gpu]')")


def _ptxas() -> bool:
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return any(bin_dir.glob("ptxas*"))


@pytest.mark.skipif(not _ptxas(), reason="this triton has no bundled ptxas")
def test_kernels_compile_for_sm90_with_vector_rows_and_release_acquire_flags():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("compile_kernels.py"))],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 16 and all(r["cubin_bytes"] > 0 for r in rows)
    for variant in ("p32", "ones"):
        _check_ptx({r["kernel"]: r for r in rows if r["variant"] == variant})


#: what another program of the same single kernel writes while this one runs: read past L1
PEER_WRITTEN = {"ubep_dispatch": ("counts", "win", "win_w", "win_ts"), "ubep_combine": ("cwin",)}
#: acquire polls per kernel: two per `_poll` (its first load, then the one in its loop);
#: dispatch polls count flags and row flags, combine row flags
ACQUIRES = {"ubep_dispatch": 4, "ubep_combine": 2}
#: scalar words of PEER_WRITTEN (not rows): counts, weights, (token, slot) words
CG_WORDS = {"ubep_dispatch": 3, "ubep_combine": 0}


def _check_ptx(got: dict) -> None:
    """Mutations this fails on: `_place_rows(..., POLL=False)` in `ubep_dispatch` or
    `_reduce(..., POLL=False)` in `ubep_combine` (an acquire count drops); the
    `cache_modifier=".cg"` removed from the load of any PEER_WRITTEN word (counts in
    `_offsets`, `win_w` / `win_ts` in `_place_rows`, rows in `_copy_rows`)."""
    for name in ("bsp_send", "bsp_reorder", "bsp_send_back", "ubep_dispatch", "ubep_combine"):
        assert got[name]["vector_ld"] and got[name]["vector_st"], name
        assert got[name]["l1_bypass"], name
    # dispatch: count flags and row flags; combine: row flags
    assert got["ubep_dispatch"]["release"] == 2 and got["ubep_combine"]["release"] == 1
    for name, n in ACQUIRES.items():
        assert got[name]["acquire"] == n, (name, got[name]["acquire"], n)
    for name in ("bsp_counts", "bsp_send", "bsp_reorder", "bsp_send_back", "bsp_reduce"):
        assert not got[name]["acquire"] and not got[name]["release"], name
    for name, peer_written in PEER_WRITTEN.items():
        loads = got[name]["loads"]
        assert all(arg is not None for arg, _ in loads), (name, loads)   # every load traced
        for arg in peer_written:
            modifiers = [m for a, m in loads if a == arg]
            assert modifiers and all(m == "cg" for m in modifiers), (name, arg, modifiers)
        assert got[name]["cg_words"] >= CG_WORDS[name], (name, got[name]["cg_words"])
