"""The direct path's kernels as C entry points, for `ubep.native`'s compiled call path.

`ubep.native.direct_dispatch` / `direct_combine` call these by address (numba `cfunc`s), with
no Python in between: each takes the path's kept state `st` (`ST_*` words: addresses and sizes
of its arrays, constants) and one call's block `c` (`DISPATCH_*` / `COMBINE_*` words, the C++
side fills the inputs and reads the outputs back). They run the same kernels the Python path
calls (`kernels.py`), so the protocol lives in one place.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, types

from ubep.native.layout import (  # the blocks' words (C++ reads them too)
    C_CODE,
    C_COPY_N,
    C_COPY_SRC,
    C_ECODE,
    C_EPOCH,
    C_ES,
    C_IDX,
    C_K,
    C_LEFT,
    C_N,
    C_OFFSET,
    C_OUT,
    C_POS,
    C_RB,
    C_SRC,
    C_T,
    C_W,
    C_WAITING,
    C_WEIGHTED,
    C_Y,
    D_CODE,
    D_DST,
    D_EPOCH,
    D_IDX,
    D_INTS,
    D_K,
    D_LEFT,
    D_MISSING,
    D_N,
    D_POS,
    D_RB,
    D_ROFF,
    D_T,
    D_TPE,
    D_W,
    D_WTS,
    D_X,
    ST_BASES,
    ST_COUNTS,
    ST_DLAY,
    ST_DLAY_N,
    ST_DONE_FIRST,
    ST_DONE_MINE,
    ST_DONE_T,
    ST_EL,
    ST_EXPERTS,
    ST_GOT,
    ST_HIDDEN,
    ST_LUT,
    ST_RANK,
    ST_READY,
    ST_SPINS,
    ST_TAILS,
    ST_WORLD,
)
from ubep.runtime.shm.atomics import f32_ptr, i64_ptr, void_ptr
from ubep.runtime.shm.direct.kernels import (
    combine_begin_at,
    dispatch_begin_at,
    dispatch_rows_at,
)
from ubep.runtime.shm.kernels import jit

_SIG = types.void(types.CPointer(types.int64), types.CPointer(types.int64))


@jit
def _state(st):
    """The kept arrays `st` points at."""
    world, e_n = st[ST_WORLD], st[ST_EXPERTS]
    bases = carray(i64_ptr(st[ST_BASES]), (world,))
    dlay = carray(i64_ptr(st[ST_DLAY]), (st[ST_DLAY_N],))
    counts = carray(i64_ptr(st[ST_COUNTS]), (world, e_n))
    tails = carray(i64_ptr(st[ST_TAILS]), (world, 4))
    return bases, dlay, counts, tails


@cfunc(_SIG, cache=True, nogil=True)
def dispatch_begin_c(st, c):
    """`dispatch_begin_at`: publish my counts, a first look at everyone's."""
    bases, dlay, counts, tails = _state(st)
    got = carray(void_ptr(st[ST_GOT]), (st[ST_WORLD],), np.int8)
    left, n = dispatch_begin_at(bases, dlay, st[ST_RANK], c[D_EPOCH], c[D_IDX], c[D_T], c[D_K],
                                st[ST_EXPERTS], c[D_CODE], c[D_ROFF], counts, tails, got,
                                st[ST_SPINS])
    c[D_LEFT] = left
    c[D_N] = n


@cfunc(_SIG, cache=True, nogil=True)
def dispatch_rows_c(st, c):
    """`dispatch_rows_at` into the result arrays the C++ side made for N = `c[D_N]` rows."""
    bases, dlay, counts, tails = _state(st)
    n = c[D_N]
    tpe = carray(i64_ptr(c[D_TPE]), (st[ST_EL],))
    ints = carray(i64_ptr(c[D_INTS]), (3, n))
    wts = carray(f32_ptr(c[D_WTS]), (n,))
    n, missing = dispatch_rows_at(bases, dlay, st[ST_RANK], c[D_EPOCH], c[D_CODE], tails, counts,
                                  st[ST_EL], c[D_IDX], c[D_W], c[D_T], c[D_K], c[D_POS], tpe,
                                  ints, wts, c[D_X], c[D_RB], c[D_DST], st[ST_SPINS])
    c[D_N] = n
    c[D_MISSING] = missing


@cfunc(_SIG, cache=True, nogil=True)
def combine_begin_c(st, c):
    """`combine_begin_at`: copy in, publish, sum, and done-reading once every token is in."""
    bases, dlay, _, _ = _state(st)
    world = st[ST_WORLD]
    src = carray(i64_ptr(c[C_SRC]), (c[C_N],))
    lut = carray(f32_ptr(st[ST_LUT]), (1,))
    ready = carray(i64_ptr(st[ST_READY]), (world,))
    done = carray(void_ptr(st[ST_DONE_T]), (c[C_T],), np.uint8)
    mine = carray(i64_ptr(st[ST_DONE_MINE]), (world,))
    left, waiting = combine_begin_at(
        bases, dlay, st[ST_RANK], c[C_EPOCH], c[C_CODE], c[C_OFFSET], c[C_COPY_SRC], c[C_COPY_N],
        src, c[C_IDX], c[C_W], c[C_T], c[C_K], c[C_WEIGHTED] != 0, c[C_POS], st[ST_EL],
        c[C_RB], c[C_ES], c[C_ECODE], lut, ready, done, c[C_Y], c[C_OUT], st[ST_HIDDEN],
        st[ST_SPINS], mine, st[ST_DONE_FIRST])
    c[C_LEFT] = left
    c[C_WAITING] = waiting
