"""Combine rows: back to their source's window at slot token*KMAX + k, summed per token.

The source sums a token once all of its routed slots arrived, in slot order as the reference
does, converting each stored element to fp32 (`ELEM_*`).
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.runtime.shm.atomics import bits_to_f32, cpu_pause, f32_ptr, u8_ptr, u16_ptr
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.records import (
    FMT_DC,
    FMT_SP,
    FMT_SW,
    blocks_ready,
    markers_checksum,
    num_blocks,
    rearm,
    write_record,
)
from ubep.runtime.shm.kernels.slots import batch_complete
from ubep.runtime.shm.region import (
    L_BB,
    L_CSLOTS,
    L_CSTRIDE,
    L_CWIN_OFF,
    L_EL,
    L_FMT,
    L_KMAX,
    L_PPB,
    L_WORLD,
)

#: combine row element codes: how `reduce` turns stored elements into fp32
ELEM_F32, ELEM_BF16, ELEM_LUT16, ELEM_LUT8 = 0, 1, 2, 3


@jit
def _send_back_row(bases, lay, epoch, rows, src_rank, src_tok, src_slot, i, head, cs):
    """Write expert-output row i to its source's window at slot token*KMAX + k."""
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    kmax, stride = lay[L_KMAX], lay[L_CSTRIDE]
    win = lay[L_CWIN_OFF] + (epoch & 1) * lay[L_CSLOTS] * stride
    rb = rows.shape[1]
    s = src_rank[i]
    slot = src_tok[i] * kmax + src_slot[i]
    cs[s] += write_record(bases[s] + win + slot * stride, bb, ppb, fmt, head, 0, rows[i], rb,
                          epoch, slot * num_blocks(rb, ppb))


@jit
def send_back(bases, lay, epoch, rows, src_rank, src_tok, src_slot, lo, hi, cs):
    """Write expert-output rows [lo, hi) to their sources' windows."""
    head = np.zeros(1, np.uint8)
    for i in range(lo, hi):
        _send_back_row(bases, lay, epoch, rows, src_rank, src_tok, src_slot, i, head, cs)


@jit
def send_back_list(bases, lay, epoch, rows, src_rank, src_tok, src_slot, items, cs):
    """`send_back` of the rows `items` (indices, in that order): a worker's schedule."""
    head = np.zeros(1, np.uint8)
    for q in range(items.shape[0]):
        _send_back_row(bases, lay, epoch, rows, src_rank, src_tok, src_slot, items[q], head,
                       cs)


@jit
def accumulate(src, bb, ppb, rb, es, elem, lut, wgt, y):
    """y += wgt * row, the row's elements read from blocks at src and converted to fp32."""
    nb = num_blocks(rb, ppb)
    for b in range(nb):
        p0 = b * ppb
        p1 = min(p0 + ppb, rb)
        if p1 <= p0:
            break
        blk = src + b * bb
        i0 = p0 // es
        n = (p1 - p0) // es
        yv = y[i0:i0 + n]            # a view from 0: index provably >= 0, loop vectorizes
        if elem == ELEM_F32:
            v = carray(f32_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * v[i]
        elif elem == ELEM_BF16:
            v16 = carray(u16_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * bits_to_f32(np.uint32(v16[i]) << np.uint32(16))
        elif elem == ELEM_LUT16:
            v16 = carray(u16_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * lut[v16[i]]
        else:
            v8 = carray(u8_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * lut[v8[i]]


@jit
def reduce_tokens(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello, tlo, thi,
                  done, batch, y, spins):
    """Sum each token of [tlo, thi) once all its routed slots arrived; return tokens missing.

    `y` `[T, hidden]` float32 (zeroed by the caller); slot order as the reference sums.
    """
    el = lay[L_EL]
    world = lay[L_WORLD]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    kmax, stride = lay[L_KMAX], lay[L_CSTRIDE]
    par = epoch & 1
    nb = num_blocks(rb, ppb)
    win = base + lay[L_CWIN_OFF] + par * lay[L_CSLOTS] * stride
    t_n, k_n = idx.shape
    remaining = 0
    for _ in range(max(spins, 1)):
        if fmt == FMT_SW or fmt == FMT_DC:
            for r in range(world):
                if batch[r] == 1 or hello[r, 0] < 0:
                    continue
                ok, total = batch_complete(base, lay, True, epoch, r, hello[r, 0])
                if ok and fmt == FMT_DC:
                    mine = np.int64(0)
                    for t in range(t_n):
                        for k in range(k_n):
                            e = idx[t, k]
                            if e >= 0 and e // el == r:
                                slot = t * kmax + k
                                mine += markers_checksum(win + slot * stride, nb, bb, slot * nb)
                    ok = mine == total
                    if not ok:
                        batch[r] = -1
                if ok:
                    batch[r] = 1
        remaining = 0
        for t in range(tlo, thi):
            if done[t]:
                continue
            ready = True
            for k in range(k_n):
                e = idx[t, k]
                if e < 0:
                    continue
                if fmt == FMT_SW or fmt == FMT_DC:
                    if batch[e // el] != 1:
                        ready = False
                        break
                elif not blocks_ready(win + (t * kmax + k) * stride, nb, bb, fmt, epoch):
                    ready = False
                    break
            if not ready:
                remaining += 1
                continue
            for k in range(k_n):
                e = idx[t, k]
                if e < 0:
                    continue
                src = win + (t * kmax + k) * stride
                # unweighted: a weight of 1.0 (x * 1.0 is exact, so the sum equals the
                # reference's plain sum bit for bit)
                wgt = weights[t, k] if weighted else np.float32(1.0)
                accumulate(src, bb, ppb, rb, es, elem, lut, wgt, y[t])
                if fmt == FMT_SP:
                    rearm(src, nb, bb)
            done[t] = 1
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining



@jit
def f32_to_bf16(y, out):
    """Round fp32 to bf16 bits (nearest even; NaN -> 0x7FC0), exactly as torch does.

    Done here because torch's `.to()` on large tensors fans out to OpenMP threads, which stall
    for milliseconds when the other cores are busy spinning ranks.
    """
    yu = y.view(np.uint32)
    for i in range(yu.shape[0]):
        for j in range(yu.shape[1]):
            u = yu[i, j]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                out[i, j] = np.uint16(0x7FC0)
            else:
                bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
                out[i, j] = np.uint16((u + bias) >> np.uint32(16))
