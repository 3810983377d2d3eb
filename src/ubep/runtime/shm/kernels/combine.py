"""Combine rows: back to their source's window at slot token*KMAX + k, summed per token.

The source sums a token once all of its routed slots arrived, in slot order as the reference
does, converting each stored element to fp32 (`ELEM_*`).
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.runtime.shm.atomics import (
    HALF_IN_HARDWARE,
    bits_to_f32,
    cpu_pause,
    f32_bits_to_half,
    f32_ptr,
    half_bits_to_f32,
    u8_ptr,
    u16_ptr,
)
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

#: combine row element codes: how `reduce` turns stored elements into fp32 (LUT8: through a
#: table of the 256 bit patterns' values, for the fp8 formats)
ELEM_F32, ELEM_BF16, ELEM_F16, ELEM_LUT8 = 0, 1, 2, 3


@jit
def f16_to_f32_soft(h):
    """The fp32 value of fp16 bits `h` in integers, exactly as torch converts (NaNs
    quieted, payloads kept): `f16_to_f32` where the CPU has no fp16 conversion."""
    u = np.uint32(h)
    x = u & np.uint32(0x7FFF)
    sign = (u & np.uint32(0x8000)) << np.uint32(16)
    r = bits_to_f32(sign | ((x << np.uint32(13)) + np.uint32(0x38000000)))   # normal
    if x >= np.uint32(0x7C00):                                                # inf, NaN
        q = np.uint32(0x400000) if x > np.uint32(0x7C00) else np.uint32(0)
        r = bits_to_f32(sign | q | ((x << np.uint32(13)) + np.uint32(0x70000000)))
    if x < np.uint32(0x400):                                                  # 0, subnormal
        r = np.float32(x) * np.float32(5.9604644775390625e-08) \
            * (np.float32(1.0) - np.float32(2.0) * np.float32(sign >> np.uint32(31)))
    return r


@jit
def f32_to_f16_soft(u):
    """fp32 bits `u` rounded to fp16 bits in integers, bit for bit as torch's
    `.to(torch.float16)` (nearest even; beyond the largest half -> inf; NaN quieted, its
    payload's top bits kept): `f32_bits_to_f16` where the CPU has no fp16 conversion."""
    sign = np.uint16((u >> np.uint32(16)) & np.uint32(0x8000))
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):                     # NaN
        h = np.uint32(0x7E00) | ((a >> np.uint32(13)) & np.uint32(0x3FF))
    elif a >= np.uint32(0x477FF000):                  # >= 65520: rounds past 65504
        h = np.uint32(0x7C00)
    elif a >= np.uint32(0x38800000):                  # a normal half: rebias, round
        h = (a - np.uint32(0x38000000)) >> np.uint32(13)
        rem = a & np.uint32(0x1FFF)
        if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1))):
            h += np.uint32(1)
    elif a <= np.uint32(0x33000000):                  # <= 2^-25: rounds to zero
        h = np.uint32(0)
    else:                                             # a subnormal half: m * 2^(e-126)
        e = a >> np.uint32(23)
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        shift = np.uint32(126) - e
        h = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (h & np.uint32(1))):
            h += np.uint32(1)
    return sign | np.uint16(h)


#: fp16 <-> fp32 of one element: one instruction where the CPU has it (a row's loop then
#: vectorizes: sums ~5x faster than a table lookup per element, rounding ~50x than numpy's
#: `astype`; docs/results/dtypes.md)
f16_to_f32 = half_bits_to_f32 if HALF_IN_HARDWARE else f16_to_f32_soft
f32_bits_to_f16 = f32_bits_to_half if HALF_IN_HARDWARE else f32_to_f16_soft


@jit
def _send_back_row(bases, lay, epoch, rows, src_rank, src_tok, src_slot, i, head, cs):
    """Write expert-output row i to its source's window at slot token*KMAX + k."""
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    rb = rows.shape[1]
    nb = num_blocks(rb, ppb)
    stride = nb * bb                         # this call's rows, packed (see `region`)
    s = src_rank[i]
    slot = src_tok[i] * lay[L_KMAX] + src_slot[i]
    win = lay[L_CWIN_OFF] + (epoch & 1) * lay[L_CSLOTS] * lay[L_CSTRIDE]
    cs[s] += write_record(bases[s] + win + slot * stride, bb, ppb, fmt, head, 0, rows[i], rb,
                          epoch, slot * nb)


@jit
def send_back(bases, lay, epoch, rows, src_rank, src_tok, src_slot, lo, hi, cs):
    """Write expert-output rows [lo, hi) to their sources' windows."""
    send_back_except(bases, lay, epoch, rows, src_rank, src_tok, src_slot, lo, hi, cs, -1)


@jit
def send_back_except(bases, lay, epoch, rows, src_rank, src_tok, src_slot, lo, hi, cs, keep):
    """`send_back` of the rows whose source is not rank `keep` (-1: none kept): those the
    source reads where they lie (`reduce_tokens_mine`)."""
    head = np.zeros(1, np.uint8)
    for i in range(lo, hi):
        if src_rank[i] != keep:
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
        elif elem == ELEM_F16:
            v16 = carray(u16_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * f16_to_f32(v16[i])
        else:
            v8 = carray(u8_ptr(blk), n)
            for i in range(n):
                yv[i] += wgt * lut[v8[i]]


@jit
def _add_fours(srcs, blks, wgts, m, b, n, elem, a):
    """`a[i] += w_j * row_j[i]` for rows j = 0, 1, ... four at a time (bf16 or fp32 rows,
    block `b`), each sum in slot order as one row at a time would do it: one pass over `a`
    per four rows instead of per row (the batch-128 combine's sums ~20% faster). Returns
    the rows done (a multiple of four); the caller adds the rest."""
    j = 0
    while j + 3 < m:
        s0, s1 = srcs[j] + b * blks[j], srcs[j + 1] + b * blks[j + 1]
        s2, s3 = srcs[j + 2] + b * blks[j + 2], srcs[j + 3] + b * blks[j + 3]
        w0, w1, w2, w3 = wgts[j], wgts[j + 1], wgts[j + 2], wgts[j + 3]
        if elem == ELEM_BF16:
            v0, v1 = carray(u16_ptr(s0), n), carray(u16_ptr(s1), n)
            v2, v3 = carray(u16_ptr(s2), n), carray(u16_ptr(s3), n)
            for i in range(n):
                a[i] = (((a[i] + w0 * bits_to_f32(np.uint32(v0[i]) << np.uint32(16)))
                         + w1 * bits_to_f32(np.uint32(v1[i]) << np.uint32(16)))
                        + w2 * bits_to_f32(np.uint32(v2[i]) << np.uint32(16))) \
                    + w3 * bits_to_f32(np.uint32(v3[i]) << np.uint32(16))
        else:
            f0, f1 = carray(f32_ptr(s0), n), carray(f32_ptr(s1), n)
            f2, f3 = carray(f32_ptr(s2), n), carray(f32_ptr(s3), n)
            for i in range(n):
                a[i] = (((a[i] + w0 * f0[i]) + w1 * f1[i]) + w2 * f2[i]) + w3 * f3[i]
        j += 4
    return j


@jit
def sum_slots(srcs, blks, wgts, m, epb, es, elem, lut, acc, y, out16):
    """One token's sum: `sum_j wgts[j] * row_j` over the m rows at `srcs[:m]`, in fp32.

    Row j's elements lie in blocks of `epb` elements, `blks[j]` bytes apart (the wire
    format; a contiguous row: `epb * es`). Each block of the token is summed over all its rows
    at once in `acc` (`[>= epb]` float32) and written once: into `y` (`[hidden]` float32)
    if it has elements, rounded to the rows' own 16-bit format (fp16 bits where `elem` is
    `ELEM_F16`, else bf16 bits) into `out16` if that has. One pass over the
    output instead of one per row, and no zeroing or rounding pass after. Per element the
    arithmetic is the reference's: 0.0, then `+= w * row` in slot order.
    """
    hidden = max(y.shape[0], out16.shape[0])
    for c0 in range(0, hidden, epb):
        n = min(epb, hidden - c0)
        a = acc[:n]                  # views from 0: indices provably >= 0, loops vectorize
        for i in range(n):
            a[i] = 0.0
        b = c0 // epb
        j0 = 0
        if elem == ELEM_BF16 or elem == ELEM_F32:
            j0 = _add_fours(srcs, blks, wgts, m, b, n, elem, a)
        for j in range(j0, m):
            src = srcs[j] + b * blks[j]
            wgt = wgts[j]
            if elem == ELEM_F32:
                v = carray(f32_ptr(src), n)
                for i in range(n):
                    a[i] += wgt * v[i]
            elif elem == ELEM_BF16:
                v16 = carray(u16_ptr(src), n)
                for i in range(n):
                    a[i] += wgt * bits_to_f32(np.uint32(v16[i]) << np.uint32(16))
            elif elem == ELEM_F16:
                v16 = carray(u16_ptr(src), n)
                for i in range(n):
                    a[i] += wgt * f16_to_f32(v16[i])
            else:
                v8 = carray(u8_ptr(src), n)
                for i in range(n):
                    a[i] += wgt * lut[v8[i]]
        if y.shape[0]:
            yv = y[c0:c0 + n]
            for i in range(n):
                yv[i] = a[i]
        if out16.shape[0]:
            if elem == ELEM_F16:
                f32_to_f16_row(a, out16[c0:c0 + n])
            else:
                f32_to_bf16_row(a, out16[c0:c0 + n])


@jit
def reduce_tokens(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello, tlo, thi,
                  done, batch, y, spins):
    """Sum each token of [tlo, thi) once all its routed slots arrived into `y` `[T, hidden]`
    float32; return tokens missing (`reduce_tokens_into` without 16-bit output)."""
    return reduce_tokens_into(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut,
                              hello, tlo, thi, done, batch, y, np.zeros((0, 0), np.uint16),
                              spins)


@jit
def reduce_tokens_into(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello,
                       tlo, thi, done, batch, y, out16, spins):
    """Sum each token of [tlo, thi) once all its routed slots arrived; return tokens missing.

    Slot order as the reference sums (`sum_slots`). Each finished token's fp32 sum goes to
    `y[t]` (`[T, hidden]`), or, if `out16` has rows, only rounded into `out16[t]` in the
    rows' own 16-bit format (bf16 or fp16 bits). A token with no routed slot gets zeros.
    """
    return reduce_tokens_mine(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello,
                              tlo, thi, done, batch, y, out16, -1, np.zeros(0, np.int64), 0,
                              spins)


@jit
def reduce_tokens_mine(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello,
                       tlo, thi, done, batch, y, out16, me, row_of_slot, rows_addr, spins):
    """`reduce_tokens_into`, where `me` >= 0 kept its own experts' rows
    (`send_back_except`): slot t*KMAX + k of mine is row `row_of_slot[t*KMAX + k]` of the
    contiguous expert outputs at `rows_addr`, read there (no window, flags or checksum).
    """
    el = lay[L_EL]
    world = lay[L_WORLD]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    kmax = lay[L_KMAX]
    nb = num_blocks(rb, ppb)
    stride = nb * bb                         # as the senders packed them
    win = base + lay[L_CWIN_OFF] + (epoch & 1) * lay[L_CSLOTS] * lay[L_CSTRIDE]
    t_n, k_n = idx.shape
    epb = ppb // es
    srcs = np.empty(k_n, np.int64)
    blks = np.empty(k_n, np.int64)
    in_win = np.empty(k_n, np.bool_)
    wgts = np.empty(k_n, np.float32)
    acc = np.empty(epb, np.float32)
    rounded = out16.shape[0] > 0
    no_y = np.empty(0, np.float32)
    no_out = np.empty(0, np.uint16)
    remaining = 0
    for _ in range(max(spins, 1)):
        if fmt == FMT_SW or fmt == FMT_DC:
            for r in range(world):
                if batch[r] == 1 or hello[r, 0] < 0:
                    continue
                if r == me:                 # nothing of mine went through my window
                    batch[r] = 1
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
                if e < 0 or e // el == me:
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
            m = 0
            for k in range(k_n):
                e = idx[t, k]
                if e < 0:
                    continue
                in_win[m] = e // el != me
                if in_win[m]:
                    srcs[m] = win + (t * kmax + k) * stride
                    blks[m] = bb
                else:
                    srcs[m] = rows_addr + row_of_slot[t * kmax + k] * rb
                    blks[m] = epb * es
                # unweighted: a weight of 1.0 (x * 1.0 is exact, so the sum equals the
                # reference's plain sum bit for bit)
                wgts[m] = weights[t, k] if weighted else np.float32(1.0)
                m += 1
            if rounded:
                sum_slots(srcs, blks, wgts, m, epb, es, elem, lut, acc, no_y, out16[t])
            else:
                sum_slots(srcs, blks, wgts, m, epb, es, elem, lut, acc, y[t], no_out)
            if fmt == FMT_SP:
                for j in range(m):
                    if in_win[j]:
                        rearm(srcs[j], nb, bb)
            done[t] = 1
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining


@jit
def f32_to_bf16_row(y, out):
    """`f32_to_bf16` of one row: fp32 `y` `[n]` rounded into the bf16 bits `out` `[n]`."""
    yu = y.view(np.uint32)
    for j in range(yu.shape[0]):
        u = yu[j]
        if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            out[j] = np.uint16(0x7FC0)
        else:
            bias = np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
            out[j] = np.uint16((u + bias) >> np.uint32(16))


@jit
def f32_to_f16_row(y, out):
    """`f32_to_f16` of one row: fp32 `y` `[n]` rounded into the fp16 bits `out` `[n]`."""
    yu = y.view(np.uint32)
    for j in range(yu.shape[0]):
        out[j] = f32_bits_to_f16(yu[j])


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


@jit
def f32_to_f16(y, out):
    """Round fp32 `y` `[n, m]` to fp16 bits `out`, bit for bit as torch's
    `.to(torch.float16)` (see `f32_to_f16_soft`), single-threaded (see `f32_to_bf16`)."""
    yu = y.view(np.uint32)
    for i in range(yu.shape[0]):
        for j in range(yu.shape[1]):
            out[i, j] = f32_bits_to_f16(yu[i, j])
