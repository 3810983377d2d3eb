"""The compiled pass over a routing that `ubep.validate` runs on every dispatch (Numba).

A module of its own so that `import ubep` does not import Numba (nor, through Numba, SciPy
and PyYAML where they are installed): `ubep.validate` imports it on its first scan.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ubep.runtime.shm.atomics import i64_ptr


@njit(cache=True, nogil=True)
def scan_topk(idx: np.ndarray, num_experts: int) -> tuple[int, int, int]:
    """One pass over `[T, K]` ids: (0, 0, 0) if valid, (1, row, id) out of range,
    (2, row, id) repeated in a row. Runs on every dispatch, so it is compiled: ~1 µs."""
    for t in range(idx.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            if e < -1 or e >= num_experts:
                return 1, t, e
            if e >= 0:
                for j in range(k):
                    if idx[t, j] == e:
                        return 2, t, e
    return 0, 0, 0


@njit(cache=True, nogil=True)
def topk_ok_at(addr: int, rows: int, cols: int, num_experts: int) -> bool:
    """`scan_topk` of the contiguous int64 `[rows, cols]` at `addr`: True if valid.

    Takes the tensor's address, not an array: building a numpy view of a tensor costs more
    than the scan of a small batch."""
    code, _, _ = scan_topk(carray(i64_ptr(addr), (rows, cols)), num_experts)
    return code == 0
