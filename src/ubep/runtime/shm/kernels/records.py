"""A row on the wire: records cut into blocks whose last word is the marker (or flag).

A record (dispatch: a 16-byte header then the row; combine: the row) is cut into blocks of
`bb` bytes. tff keeps the last 8 bytes of each block for a flag that holds the epoch; sw,
dc and sp fill the block and store its last payload word last, with a release store: that
word is the block's marker (sp: it differs from the sentinel once written; dc: the markers
are summed into a checksum).
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.plan.blocks import SENTINEL_I64
from ubep.runtime.shm.atomics import load_acquire, store_release, u8_ptr
from ubep.runtime.shm.kernels import jit

FMT_SW, FMT_TFF, FMT_DC, FMT_SP = 0, 1, 2, 3
SENT = SENTINEL_I64
_C1 = -7046029254386353131   # 0x9E3779B97F4A7C15
_C2 = -4658895280553007687   # 0xBF58476D1CE4E5B9


@jit
def mix(m, bid):
    """dc: a marker word mixed with its block id, the term a checksum sums."""
    return (m ^ (bid * _C1)) * _C2


@jit
def _rec_byte(head, hl, body, bl, q):
    if q < hl:
        return np.int64(head[q])
    q -= hl
    if q < bl:
        return np.int64(body[q])
    return np.int64(0)


@jit
def rec_word(head, hl, body, bl, pos):
    """The 8 record bytes at `pos` as a little-endian int64 (zeros past the record)."""
    w = np.int64(0)
    for i in range(8):
        w |= _rec_byte(head, hl, body, bl, pos + i) << np.int64(8 * i)
    return w


@jit
def copy_bytes(dst_addr, src_addr, n):
    """n bytes from src_addr to dst_addr by our own (vectorized) loop, never memcpy.

    Both views start at index 0 so the loop index is provably non-negative (no wraparound
    checks) and LLVM vectorizes it. It does not turn it into memcpy (a test pins that).
    """
    d = carray(u8_ptr(dst_addr), n)
    s = carray(u8_ptr(src_addr), n)
    for j in range(n):
        d[j] = s[j]


@jit
def _copy_out(dst_addr, head_addr, hl, body_addr, a, c):
    """Copy record bytes [a, c) (header then body) to dst_addr."""
    i = a
    if i < hl:
        m = min(c, hl) - i
        copy_bytes(dst_addr, head_addr + i, m)
        i += m
    if i < c:
        copy_bytes(dst_addr + (i - a), body_addr + (i - hl), c - i)


@jit
def _copy_in(src_addr, head_addr, hl, body_addr, a, c):
    """Copy record bytes [a, c) from src_addr into header/body (the inverse of _copy_out)."""
    i = a
    if i < hl:
        m = min(c, hl) - i
        copy_bytes(head_addr + i, src_addr, m)
        i += m
    if i < c:
        copy_bytes(body_addr + (i - hl), src_addr + (i - a), c - i)


@jit
def num_blocks(rec, ppb):
    n = (rec + ppb - 1) // ppb
    return n if n > 0 else 1


@jit
def write_record(dst, bb, ppb, fmt, head, hl, body, bl, epoch, bid0):
    """Write one record as blocks at `dst`, each block's marker word last (release).

    Returns the record's checksum term (dc: sum of mixed marker words).
    """
    rec = hl + bl
    nb = num_blocks(rec, ppb)
    cs = np.int64(0)
    head_addr = head.ctypes.data
    body_addr = body.ctypes.data
    for b in range(nb):
        blk = dst + b * bb
        p0 = b * ppb
        if fmt == FMT_TFF:
            p1 = min(p0 + ppb, rec)
            if p1 > p0:
                _copy_out(blk, head_addr, hl, body_addr, p0, p1)
            store_release(blk + bb - 8, epoch)
        else:
            p1 = min(p0 + bb - 8, rec)
            if p1 > p0:
                _copy_out(blk, head_addr, hl, body_addr, p0, p1)
            m = rec_word(head, hl, body, bl, p0 + bb - 8)
            store_release(blk + bb - 8, m)
            cs += mix(m, bid0 + b)
    return cs


@jit
def blocks_ready(src, nb, bb, fmt, epoch):
    """tff: every block's flag holds `epoch`; sp: no marker holds the sentinel."""
    for b in range(nb):
        v = load_acquire(src + b * bb + bb - 8)
        if fmt == FMT_TFF:
            if v != epoch:
                return False
        elif v == SENT:
            return False
    return True


@jit
def read_record(src, bb, ppb, head, hl, body, bl):
    rec = hl + bl
    nb = num_blocks(rec, ppb)
    head_addr = head.ctypes.data
    body_addr = body.ctypes.data
    for b in range(nb):
        p0 = b * ppb
        p1 = min(p0 + ppb, rec)
        if p1 > p0:
            _copy_in(src + b * bb, head_addr, hl, body_addr, p0, p1)


@jit
def rearm(src, nb, bb):
    for b in range(nb):
        store_release(src + b * bb + bb - 8, SENT)


@jit
def markers_checksum(src, nb, bb, bid0):
    cs = np.int64(0)
    for b in range(nb):
        cs += mix(load_acquire(src + b * bb + bb - 8), bid0 + b)
    return cs


