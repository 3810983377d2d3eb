"""recv_x's gather in destination order vs source order (`torch_layout.gather_rows`) vs one
memcpy of as many rows, batch-128-like: 256 source rows of 14 KB, each to ~4 of 8 experts.

Not a test (pytest does not collect it). One process, outputs rotating over three arrays so
they are not in cache, as recv_x is not.

    .venv/bin/python -m benchmarks bench_gather_order
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from ubep.runtime.shm.atomics import memcpy_at
from ubep.runtime.torch_layout import copy_row, gather_rows


@njit(nogil=True)
def _destination_order(src, gather, out, rw):
    for i in range(gather.shape[0]):
        copy_row(out, i * rw, src, gather[i] * rw, rw)


@njit(nogil=True)
def _one_memcpy(src, out, nbytes):
    memcpy_at(out.ctypes.data, src.ctypes.data, nbytes)


def main() -> None:
    rng = np.random.default_rng(0)
    sources, rb, experts = 256, 7168 * 2, 8
    src = rng.integers(0, 255, sources * rb, dtype=np.uint8)
    routed = rng.random((sources, experts)) < 0.5
    gather = np.concatenate([np.flatnonzero(routed[:, e]) for e in range(experts)])
    n = len(gather)
    outs = [np.zeros(n * rb, np.uint8) for _ in range(3)]
    none = np.zeros(0, np.int64)
    _destination_order(src, gather, outs[0], rb)
    gather_rows(src, src, gather, sources, none, outs[1], rb)
    _one_memcpy(outs[1], outs[2], n * rb)
    assert (outs[0] == outs[1]).all()
    times: dict[str, list[float]] = {"destination order": [], "source order": [],
                                     f"one memcpy of {n} rows": []}
    for rep in range(60):
        out = outs[rep % 3]
        for name in times:
            t0 = time.perf_counter_ns()
            if name == "destination order":
                _destination_order(src, gather, out, rb)
            elif name == "source order":
                gather_rows(src, src, gather, sources, none, out, rb)
            else:
                _one_memcpy(outs[(rep + 1) % 3], out, n * rb)
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
    print(f"{n} rows of {rb} B from {sources} sources, median of 60:")
    for name, ts in times.items():
        print(f"  {name:24s} {np.median(ts):8.1f} µs")


if __name__ == "__main__":
    main()
