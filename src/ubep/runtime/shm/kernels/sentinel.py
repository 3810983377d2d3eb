"""sp (sentinel polling): arm the windows with the sentinel; refuse rows that hold it.

A row whose marker word equals the sentinel would never be seen as arrived, so the
sender checks its rows first and aborts the call (a clear error on every rank) instead.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.runtime.shm.atomics import i64_ptr
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.records import SENT, num_blocks, rec_word
from ubep.runtime.shm.region import (
    L_BB,
    L_CSLOTS,
    L_CSTRIDE,
    L_CWIN_OFF,
    L_DROWS,
    L_DSTRIDE,
    L_DWIN_OFF,
    L_WORLD,
)


@jit
def arm_sentinels(base, lay):
    """sp: fill every marker word of this region's windows with the sentinel."""
    bb = lay[L_BB]
    # every block of the windows: a call packs its records on this block grid at its own
    # row size, and reading a record re-arms its blocks, so between calls all stay armed
    for start, nbytes in ((lay[L_DWIN_OFF], 2 * lay[L_WORLD] * lay[L_DROWS] * lay[L_DSTRIDE]),
                          (lay[L_CWIN_OFF], 2 * lay[L_CSLOTS] * lay[L_CSTRIDE])):
        for b in range(nbytes // bb):
            carray(i64_ptr(base + start + b * bb + bb - 8), 1)[0] = SENT


@jit
def _record_holds_sentinel(x, weights, t, k, bb, head):
    """Whether (token t, slot k)'s dispatch record holds the sentinel at a marker position."""
    head.view(np.int32)[0] = t
    head.view(np.int32)[1] = k
    head.view(np.float32)[2] = weights[t, k]
    rb = x.shape[1]
    for b in range(num_blocks(16 + rb, bb)):
        if rec_word(head, 16, x[t], rb, b * bb + bb - 8) == SENT:
            return True
    return False


@jit
def sp_check_dispatch(x, weights, sends, bb):
    """First send index whose record holds the sentinel at a marker position, else -1."""
    head = np.zeros(16, np.uint8)
    for i in range(sends.shape[0]):
        if _record_holds_sentinel(x, weights, sends[i, 0], sends[i, 1], bb, head):
            return i
    return -1


@jit
def sp_check_rows(rows, bb):
    """First row (no header) holding the sentinel at a marker position, else -1."""
    head = np.zeros(1, np.uint8)
    rb = rows.shape[1]
    nb = num_blocks(rb, bb)
    for i in range(rows.shape[0]):
        for b in range(nb):
            if rec_word(head, 0, rows[i], rb, b * bb + bb - 8) == SENT:
                return i
    return -1


@jit
def sp_check_routing(x, idx, weights, bb):
    """First token whose record for some routed slot holds the sentinel at a marker
    position, else -1 (checked before any worker sends: `sp_check_dispatch` without a plan)."""
    head = np.zeros(16, np.uint8)
    t_n, k_n = idx.shape
    for t in range(t_n):
        for k in range(k_n):
            if idx[t, k] >= 0 and _record_holds_sentinel(x, weights, t, k, bb, head):
                return t
    return -1
