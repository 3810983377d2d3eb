"""The one-worker path's kernels as C entry points, for `ubep.native`'s door (`staged.cpp`).

`ubep.native.staged_door_dispatch` / `staged_door_combine` take a `Buffer`'s common call on
the one-worker path (`SinglePath`: mode "ubep" or "bsp", `direct=False`) whole: they call
these by address (numba `cfunc`s) with one int64 block `c` per call (`S_*` words: the
inputs the C++ side writes, then the outputs it reads back). They run the kernels the Python
path calls (`kernels.py`), so the protocol lives in one place.
"""

from __future__ import annotations

from numba import carray, cfunc, types

from ubep.native.layout import (  # the blocks' words (C++ reads them too)
    S_CAST,
    S_ECODE,
    S_EL,
    S_ELEM,
    S_EPOCH,
    S_ES,
    S_HIDDEN,
    S_IDX,
    S_INTS,
    S_K,
    S_LEFT,
    S_LUT,
    S_META,
    S_N,
    S_NLUT,
    S_OUT,
    S_OUT_X,
    S_RB,
    S_RECV,
    S_ROUTED,
    S_ROWS,
    S_SENDS,
    S_SPINS,
    S_STATE,
    S_T,
    S_TPE,
    S_W,
    S_WEIGHTED,
    S_WORLD,
    S_WTS,
    S_X,
    S_Y,
)
from ubep.runtime.shm.atomics import f32_ptr, i64_ptr
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.staged.kernels import (
    RES_META,
    RES_RECV,
    RES_ROUTED,
    RES_SENDS,
    combine_begin_at,
    combine_poll_at,
    dispatch_begin_at,
    recv_rows_at,
    state_views,
)

_SIG = types.void(types.CPointer(types.int64))


@jit
def _res(c, left):
    """The call's outputs: what is still missing, and the path's result words."""
    res = state_views(c[S_STATE], c[S_WORLD], c[S_EL])[7]
    c[S_LEFT] = left
    c[S_SENDS] = res[RES_SENDS]
    c[S_META] = res[RES_META]
    c[S_RECV] = res[RES_RECV]
    c[S_ROUTED] = res[RES_ROUTED]


@cfunc(_SIG, cache=True, nogil=True)
def dispatch_begin_c(c):
    """`dispatch_begin_at`: my rows and counts sent, then everyone's counts polled for
    `S_SPINS` rounds (`S_LEFT`: sources still missing)."""
    tpe = carray(i64_ptr(c[S_TPE]), (c[S_EL],))
    left = dispatch_begin_at(c[S_STATE], c[S_EPOCH], c[S_X], c[S_T], c[S_RB], c[S_IDX],
                             c[S_K], c[S_W], c[S_ELEM], tpe, c[S_SPINS])
    _res(c, left)


@cfunc(_SIG, cache=True, nogil=True)
def dispatch_rows_c(c):
    """`recv_rows_at` of the `S_N` rows into `S_OUT_X` (`S_LEFT`: rows still missing)."""
    n = c[S_N]
    wts = carray(f32_ptr(c[S_WTS]), (n,))
    ints = carray(i64_ptr(c[S_INTS]), (3, n))
    left = recv_rows_at(c[S_STATE], c[S_EPOCH], n, c[S_OUT_X], c[S_RB], wts, ints, c[S_X],
                        c[S_T], c[S_W], c[S_K], c[S_SPINS])
    _res(c, left)


@cfunc(_SIG, cache=True, nogil=True)
def combine_begin_c(c):
    """`combine_begin_at`: the `S_N` rows at `S_ROWS` sent back (`S_LEFT` < 0: an sp
    sentinel abort, as it returns it)."""
    n = c[S_N]
    ints = carray(i64_ptr(c[S_INTS]), (3, n))
    c[S_LEFT] = combine_begin_at(c[S_STATE], c[S_EPOCH], c[S_ROWS], n, c[S_RB], ints,
                                 c[S_ELEM], c[S_T])


@cfunc(_SIG, cache=True, nogil=True)
def combine_poll_c(c):
    """`combine_poll_at`: tokens summed as their rows arrive (`S_LEFT`: still missing)."""
    left = combine_poll_at(c[S_STATE], c[S_EPOCH], c[S_IDX], c[S_W], c[S_T], c[S_K],
                           c[S_WEIGHTED] != 0, c[S_RB], c[S_ES], c[S_ECODE], c[S_LUT],
                           c[S_NLUT], c[S_Y], c[S_HIDDEN], c[S_SPINS], c[S_ELEM], c[S_CAST],
                           c[S_OUT], c[S_ROWS])
    _res(c, left)
