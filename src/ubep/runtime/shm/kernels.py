"""Numba kernels of the shm runtime: send counts and rows, poll, reorder, reduce.

Every kernel is `@njit(nogil=True, cache=True)`, so worker threads run them in parallel.
Shared words are addressed by raw address (`bases[d]` + offset, see `region.py`). Rules:

* every flag/marker read is `load_acquire` (a plain load in a spin loop gets hoisted);
* rows are copied by our own byte loops (not `memcpy`, whose store order is not defined),
  and each block's marker word is written last with `store_release`;
* waits are bounded: a poll kernel spins at most `spins` rounds with `cpu_pause` and returns
  what is still missing; the Python side backs off, checks deadline and liveness, re-enters.
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ubep.plan.blocks import SENTINEL_I64
from ubep.runtime.shm.atomics import (
    bits_to_f32,
    cpu_pause,
    f32_ptr,
    fetch_add,
    i64_ptr,
    load_acquire,
    store_release,
    u8_ptr,
    u16_ptr,
)
from ubep.runtime.shm.region import (
    L_BB,
    L_CBATCH_OFF,
    L_COUNT_OFF,
    L_CSLOTS,
    L_CSTRIDE,
    L_CW,
    L_CWIN_OFF,
    L_DBATCH_OFF,
    L_DROWS,
    L_DSTRIDE,
    L_DWIN_OFF,
    L_EL,
    L_FMT,
    L_HELLO_OFF,
    L_KMAX,
    L_MW,
    L_PPB,
    L_SIZE,
    L_WORLD,
    SLOT_ELEM,
    SLOT_NTW,
    SLOT_STATUS,
)

FMT_SW, FMT_TFF, FMT_DC, FMT_SP = 0, 1, 2, 3
SENT = SENTINEL_I64
_C1 = -7046029254386353131   # 0x9E3779B97F4A7C15
_C2 = -4658895280553007687   # 0xBF58476D1CE4E5B9
#: recv_rows: consecutive not-yet-arrived rows of a source checked per round
MAX_MISSES = 8
#: combine row element codes: how `reduce` turns stored elements into fp32
ELEM_F32, ELEM_BF16, ELEM_LUT16, ELEM_LUT8 = 0, 1, 2, 3

_jit = njit(nogil=True, cache=True)


# -- records and blocks -----------------------------------------------------------------------
@_jit
def _mix(m, bid):
    return (m ^ (bid * _C1)) * _C2


@_jit
def _rec_byte(head, hl, body, bl, q):
    if q < hl:
        return np.int64(head[q])
    q -= hl
    if q < bl:
        return np.int64(body[q])
    return np.int64(0)


@_jit
def _rec_word(head, hl, body, bl, pos):
    """The 8 record bytes at `pos` as a little-endian int64 (zeros past the record)."""
    w = np.int64(0)
    for i in range(8):
        w |= _rec_byte(head, hl, body, bl, pos + i) << np.int64(8 * i)
    return w


@_jit
def _copy_bytes(dst_addr, src_addr, n):
    """n bytes from src_addr to dst_addr by our own (vectorized) loop, never memcpy.

    Both views start at index 0 so the loop index is provably non-negative (no wraparound
    checks) and LLVM vectorizes it. It does not turn it into memcpy (a test pins that).
    """
    d = carray(u8_ptr(dst_addr), n)
    s = carray(u8_ptr(src_addr), n)
    for j in range(n):
        d[j] = s[j]


@_jit
def _copy_out(dst_addr, head_addr, hl, body_addr, a, c):
    """Copy record bytes [a, c) (header then body) to dst_addr."""
    i = a
    if i < hl:
        m = min(c, hl) - i
        _copy_bytes(dst_addr, head_addr + i, m)
        i += m
    if i < c:
        _copy_bytes(dst_addr + (i - a), body_addr + (i - hl), c - i)


@_jit
def _copy_in(src_addr, head_addr, hl, body_addr, a, c):
    """Copy record bytes [a, c) from src_addr into header/body (the inverse of _copy_out)."""
    i = a
    if i < hl:
        m = min(c, hl) - i
        _copy_bytes(head_addr + i, src_addr, m)
        i += m
    if i < c:
        _copy_bytes(body_addr + (i - hl), src_addr + (i - a), c - i)


@_jit
def num_blocks(rec, ppb):
    n = (rec + ppb - 1) // ppb
    return n if n > 0 else 1


@_jit
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
            m = _rec_word(head, hl, body, bl, p0 + bb - 8)
            store_release(blk + bb - 8, m)
            cs += _mix(m, bid0 + b)
    return cs


@_jit
def _blocks_ready(src, nb, bb, fmt, epoch):
    """tff: every block's flag holds `epoch`; sp: no marker holds the sentinel."""
    for b in range(nb):
        v = load_acquire(src + b * bb + bb - 8)
        if fmt == FMT_TFF:
            if v != epoch:
                return False
        elif v == SENT:
            return False
    return True


@_jit
def _read_record(src, bb, ppb, head, hl, body, bl):
    rec = hl + bl
    nb = num_blocks(rec, ppb)
    head_addr = head.ctypes.data
    body_addr = body.ctypes.data
    for b in range(nb):
        p0 = b * ppb
        p1 = min(p0 + ppb, rec)
        if p1 > p0:
            _copy_in(src + b * bb, head_addr, hl, body_addr, p0, p1)


@_jit
def _rearm(src, nb, bb):
    for b in range(nb):
        store_release(src + b * bb + bb - 8, SENT)


@_jit
def _markers_checksum(src, nb, bb, bid0):
    cs = np.int64(0)
    for b in range(nb):
        cs += _mix(load_acquire(src + b * bb + bb - 8), bid0 + b)
    return cs


@_jit
def arm_sentinels(base, lay):
    """sp: fill every marker word of this region's windows with the sentinel."""
    bb = lay[L_BB]
    world = lay[L_WORLD]
    for start, rows, stride in ((lay[L_DWIN_OFF], 2 * world * lay[L_DROWS], lay[L_DSTRIDE]),
                                (lay[L_CWIN_OFF], 2 * lay[L_CSLOTS], lay[L_CSTRIDE])):
        nb = stride // bb
        for r in range(rows):
            row = base + start + r * stride
            for b in range(nb):
                carray(i64_ptr(row + b * bb + bb - 8), 1)[0] = SENT


# -- planning (one token worker) ---------------------------------------------------------------
@_jit
def plan_single(idx, expert_order, static, experts_per_rank):
    """The Plan of one token worker: `(sends [N,3], window_pos [N], send_counts [E])`.

    Same arrays as `ubep.plan.make_plan(..., workers=1)`: static sends row-major; balanced
    and hierarchical sort by the position of the expert in `expert_order`, then token.
    """
    t_n, k_n = idx.shape
    e_n = expert_order.shape[0]
    counts = np.zeros(e_n, np.int64)
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e >= 0:
                counts[e] += 1
    n = 0
    start = np.empty(e_n, np.int64)
    for i in range(e_n):
        e = expert_order[i]
        start[e] = n
        n += counts[e]
    sends = np.empty((n, 3), np.int64)
    pos = np.empty(n, np.int64)
    fill = np.zeros(e_n, np.int64)
    i = 0
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e < 0:
                continue
            j = i if static else start[e] + fill[e]
            sends[j, 0] = t
            sends[j, 1] = k
            sends[j, 2] = e // experts_per_rank
            pos[j] = fill[e]
            fill[e] += 1
            i += 1
    return sends, pos, counts


# -- dispatch -----------------------------------------------------------------------------------
@_jit
def send_counts(bases, lay, me, epoch, counts, n_tw, elem, status, d_lo, d_hi):
    """Write my per-expert counts (and how many batch flags follow) into ranks [d_lo, d_hi)."""
    world, el, cw = lay[L_WORLD], lay[L_EL], lay[L_CW]
    par = epoch & 1
    for d in range(d_lo, d_hi):
        slot = bases[d] + lay[L_COUNT_OFF] + (par * world + me) * cw * 8
        w = carray(i64_ptr(slot), cw)
        for i in range(el):
            w[i] = counts[d * el + i]
        w[el + SLOT_NTW] = n_tw
        w[el + SLOT_ELEM] = elem
        w[el + SLOT_STATUS] = status
        store_release(slot + (cw - 1) * 8, epoch)


@_jit
def send_rows(bases, lay, me, epoch, x, idx, weights, sends, window_pos, counts, cs):
    """Write each send's record (meta + row) into its destination's window for me.

    `window_pos` is the row among my rows for that expert; rows of one destination are laid
    out expert by expert. Adds each destination's checksum term to `cs[d]`.
    """
    world, el = lay[L_WORLD], lay[L_EL]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    par = epoch & 1
    first = np.empty(world * el, np.int64)   # first window row of each expert at its dest
    for d in range(world):
        acc = 0
        for i in range(el):
            first[d * el + i] = acc
            acc += counts[d * el + i]
    head = np.zeros(16, np.uint8)
    head_i = head.view(np.int32)
    head_f = head.view(np.float32)
    rb = x.shape[1]
    nb = num_blocks(16 + rb, ppb)
    win = lay[L_DWIN_OFF] + (par * world + me) * lay[L_DROWS] * lay[L_DSTRIDE]
    for i in range(sends.shape[0]):
        t, k, d = sends[i, 0], sends[i, 1], sends[i, 2]
        row = first[idx[t, k]] + window_pos[i]
        head_i[0] = t
        head_i[1] = k
        head_f[2] = weights[t, k]
        dst = bases[d] + win + row * lay[L_DSTRIDE]
        cs[d] += write_record(dst, bb, ppb, fmt, head, 16, x[t], rb, epoch, row * nb)


@_jit
def write_batch_flags(bases, lay, combine, me, epoch, j, cs, corrupt):
    """sw/dc: after its rows, worker j tells every rank its batch is complete (+checksum)."""
    world, mw = lay[L_WORLD], lay[L_MW]
    off = lay[L_CBATCH_OFF] if combine else lay[L_DBATCH_OFF]
    par = epoch & 1
    for d in range(world):
        slot = bases[d] + off + ((par * world + me) * mw + j) * 64
        carray(i64_ptr(slot), 1)[0] = cs[d] + corrupt
        store_release(slot + 56, epoch)


@_jit
def poll_slots(addrs, s_lo, s_hi, last, epoch, head, tail, got, spins):
    """Collect the slots `addrs[s]` of ranks [s_lo, s_hi) whose word `last` holds `epoch`:
    their first `head.shape[1]` words into `head[s]`, the next `tail.shape[1]` into
    `tail[s]`; `got[s]` marks ranks read. Spins at most `spins` rounds; returns how many lack.
    """
    nh, nt = head.shape[1], tail.shape[1]
    missing = 0
    for _ in range(max(spins, 1)):
        missing = 0
        for s in range(s_lo, s_hi):
            if got[s]:
                continue
            if load_acquire(addrs[s] + last * 8) == epoch:
                w = carray(i64_ptr(addrs[s]), nh + nt)
                for i in range(nh):
                    head[s, i] = w[i]
                for i in range(nt):
                    tail[s, i] = w[nh + i]
                got[s] = 1
            else:
                missing += 1
        if missing == 0:
            return 0
        cpu_pause()
    return missing


@_jit
def poll_counts(base, lay, epoch, s_lo, s_hi, counts, meta, got, spins):
    """Collect the count slots of sources [s_lo, s_hi) that hold `epoch`; return how many lack.

    `counts` `[world, E/P]` and `meta` `[world, 3]` (token workers, dtype, status) receive
    the slots; `got[s]` marks sources already read.
    """
    world, cw = lay[L_WORLD], lay[L_CW]
    addrs = base + lay[L_COUNT_OFF] + ((epoch & 1) * world + np.arange(world)) * cw * 8
    return poll_slots(addrs, s_lo, s_hi, cw - 1, epoch, counts, meta, got, spins)


@_jit
def offsets(counts, out_start, tokens_per_expert):
    """Prefix sums: output row of each (source, expert) run; returns N (rows received)."""
    world, el = counts.shape
    n = 0
    for e in range(el):
        tokens_per_expert[e] = 0
        for s in range(world):
            out_start[s, e] = n
            n += counts[s, e]
            tokens_per_expert[e] += counts[s, e]
    return n


@_jit
def _batch_complete(base, lay, combine, epoch, s, n_tw):
    """sw/dc: whether source s's n_tw batch flags hold epoch; returns (done, checksum sum)."""
    world, mw = lay[L_WORLD], lay[L_MW]
    off = lay[L_CBATCH_OFF] if combine else lay[L_DBATCH_OFF]
    par = epoch & 1
    total = np.int64(0)
    for j in range(n_tw):
        slot = base + off + ((par * world + s) * mw + j) * 64
        if load_acquire(slot + 56) != epoch:
            return False, total
        total += carray(i64_ptr(slot), 1)[0]
    return True, total


@_jit
def recv_rows(base, lay, epoch, counts, meta, out_start, lo, hi, done, batch, out_x, out_w,
              out_rank, out_tok, out_slot, spins):
    """Reorder received rows [lo, hi) (source-major item order) into the expert-major output.

    A row is taken once its blocks are seen complete (tff flags / sp markers) or its source's
    batch is complete (sw) and verified (dc). `batch[s]`: 0 unknown, 1 complete, -1 dc
    checksum mismatch seen (retried). Returns the rows of [lo, hi) still missing.
    """
    world, el = lay[L_WORLD], lay[L_EL]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    stride = lay[L_DSTRIDE]
    par = epoch & 1
    rb = out_x.shape[1]
    nb = num_blocks(16 + rb, ppb)
    head = np.zeros(16, np.uint8)
    head_i = head.view(np.int32)
    head_f = head.view(np.float32)
    remaining = 0
    for _ in range(max(spins, 1)):
        remaining = 0
        g = 0
        for s in range(world):
            r_s = 0
            for e in range(el):
                r_s += counts[s, e]
            if g + r_s <= lo or g >= hi or r_s == 0:
                g += r_s
                continue
            win = base + lay[L_DWIN_OFF] + (par * world + s) * lay[L_DROWS] * stride
            if fmt == FMT_SW or fmt == FMT_DC:
                if batch[s] != 1:
                    ok, total = _batch_complete(base, lay, False, epoch, s, meta[s, 0])
                    if ok and fmt == FMT_DC:
                        mine = np.int64(0)
                        for q in range(r_s):
                            mine += _markers_checksum(win + q * stride, nb, bb, q * nb)
                        ok = mine == total
                        if not ok:
                            batch[s] = -1
                    if ok:
                        batch[s] = 1
                if batch[s] != 1:
                    for gi in range(max(g, lo), min(g + r_s, hi)):
                        if not done[gi]:
                            remaining += 1
                    g += r_s
                    continue
            # rows arrive roughly in window order: after MAX_MISSES absent rows in a row, skip
            # this source's flag checks until the next round (they cost the peer's bandwidth)
            q = 0
            misses = 0
            for e in range(el):
                for r in range(counts[s, e]):
                    gi = g + q
                    if lo <= gi < hi and not done[gi]:
                        src = win + q * stride
                        if misses >= MAX_MISSES:
                            remaining += 1
                        elif (fmt == FMT_TFF or fmt == FMT_SP) and not _blocks_ready(
                                src, nb, bb, fmt, epoch):
                            remaining += 1
                            misses += 1
                        else:
                            misses = 0
                            o = out_start[s, e] + r
                            _read_record(src, bb, ppb, head, 16, out_x[o], rb)
                            out_tok[o] = head_i[0]
                            out_slot[o] = head_i[1]
                            out_w[o] = head_f[2]
                            out_rank[o] = s
                            if fmt == FMT_SP:
                                _rearm(src, nb, bb)
                            done[gi] = 1
                    q += 1
            g += r_s
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining


# -- combine ------------------------------------------------------------------------------------
@_jit
def send_hello(bases, lay, me, epoch, n_tw, elem, status):
    """Combine: tell every rank this call started (token workers, dtype, status)."""
    world = lay[L_WORLD]
    par = epoch & 1
    for d in range(world):
        slot = bases[d] + lay[L_HELLO_OFF] + (par * world + me) * 64
        w = carray(i64_ptr(slot), 8)
        w[SLOT_NTW] = n_tw
        w[SLOT_ELEM] = elem
        w[SLOT_STATUS] = status
        store_release(slot + 56, epoch)


@_jit
def poll_hello(base, lay, epoch, meta, got, spins):
    """Collect the combine hellos of `epoch` into `meta` `[world, 3]`; return how many lack."""
    world = lay[L_WORLD]
    addrs = base + lay[L_HELLO_OFF] + ((epoch & 1) * world + np.arange(world)) * 64
    return poll_slots(addrs, 0, world, 7, epoch, meta, meta[:, :0], got, spins)


@_jit
def send_back(bases, lay, epoch, rows, src_rank, src_tok, src_slot, lo, hi, cs):
    """Write expert-output rows [lo, hi) to their source's window at slot token*KMAX + k."""
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    kmax, stride = lay[L_KMAX], lay[L_CSTRIDE]
    par = epoch & 1
    head = np.zeros(1, np.uint8)
    rb = rows.shape[1]
    nb = num_blocks(rb, ppb)
    win = lay[L_CWIN_OFF] + par * lay[L_CSLOTS] * stride
    for i in range(lo, hi):
        s = src_rank[i]
        slot = src_tok[i] * kmax + src_slot[i]
        dst = bases[s] + win + slot * stride
        cs[s] += write_record(dst, bb, ppb, fmt, head, 0, rows[i], rb, epoch, slot * nb)


@_jit
def _accumulate(src, bb, ppb, rb, es, elem, lut, wgt, y):
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


@_jit
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
                ok, total = _batch_complete(base, lay, True, epoch, r, hello[r, 0])
                if ok and fmt == FMT_DC:
                    mine = np.int64(0)
                    for t in range(t_n):
                        for k in range(k_n):
                            e = idx[t, k]
                            if e >= 0 and e // el == r:
                                slot = t * kmax + k
                                mine += _markers_checksum(win + slot * stride, nb, bb, slot * nb)
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
                elif not _blocks_ready(win + (t * kmax + k) * stride, nb, bb, fmt, epoch):
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
                _accumulate(src, bb, ppb, rb, es, elem, lut, wgt, y[t])
                if fmt == FMT_SP:
                    _rearm(src, nb, bb)
            done[t] = 1
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining


# -- sentinel checks (sp) -----------------------------------------------------------------------
@_jit
def sp_check_dispatch(x, weights, sends, bb):
    """First send index whose record holds the sentinel at a marker position, else -1."""
    head = np.zeros(16, np.uint8)
    head_i = head.view(np.int32)
    head_f = head.view(np.float32)
    rb = x.shape[1]
    nb = num_blocks(16 + rb, bb)
    for i in range(sends.shape[0]):
        t, k = sends[i, 0], sends[i, 1]
        head_i[0] = t
        head_i[1] = k
        head_f[2] = weights[t, k]
        for b in range(nb):
            if _rec_word(head, 16, x[t], rb, b * bb + bb - 8) == SENT:
                return i
    return -1


@_jit
def sp_check_rows(rows, bb):
    """First row (no header) holding the sentinel at a marker position, else -1."""
    head = np.zeros(1, np.uint8)
    rb = rows.shape[1]
    nb = num_blocks(rb, bb)
    for i in range(rows.shape[0]):
        for b in range(nb):
            if _rec_word(head, 0, rows[i], rb, b * bb + bb - 8) == SENT:
                return i
    return -1


# -- local (in-rank) synchronization ----------------------------------------------------------
@_jit
def barrier_arrive(addr):
    """Arrive at a worker barrier whose counter lives at `addr`; returns the new count."""
    return fetch_add(addr, 1) + 1


@_jit
def poll_at_least(addr, target, spins):
    """Spin until the int64 at `addr` reaches `target`; True if it did."""
    for _ in range(max(spins, 1)):
        if load_acquire(addr) >= target:
            return True
        cpu_pause()
    return False


@_jit
def publish(addr, value):
    store_release(addr, value)


# -- one worker: a call's sending side in one kernel ----------------------------------------------
@_jit
def dispatch_send_single(bases, lay, me, epoch, x, idx, weights, expert_order, static, elem,
                         corrupt, cs, bsp):
    """Plan, counts, rows and batch flags of a one-worker dispatch in one call.

    ubep order: counts first, then rows (+ sw/dc batch flags); bsp order: rows, flags, then
    counts (the Send-Flag-and-Count phase). sp: rows are checked for the sentinel first; a
    hit sends an abort in place of the counts and returns -(token + 1). Else the send count.
    """
    world = lay[L_WORLD]
    fmt = lay[L_FMT]
    sends, pos, counts = plan_single(idx, expert_order, static, lay[L_EL])
    if fmt == FMT_SP:
        bad = sp_check_dispatch(x, weights, sends, lay[L_BB])
        if bad >= 0:
            send_counts(bases, lay, me, epoch, counts, 1, elem, 1, 0, world)
            return -(sends[bad, 0] + 1)
    if not bsp:
        send_counts(bases, lay, me, epoch, counts, 1, elem, 0, 0, world)
    for d in range(world):
        cs[d] = 0
    send_rows(bases, lay, me, epoch, x, idx, weights, sends, pos, counts, cs)
    if fmt == FMT_SW or fmt == FMT_DC:
        write_batch_flags(bases, lay, 0, me, epoch, 0, cs, corrupt)
    if bsp:
        send_counts(bases, lay, me, epoch, counts, 1, elem, 0, 0, world)
    return sends.shape[0]


@_jit
def check_meta(meta, elem):
    """0 if every peer's slot is fine, 1 if one aborted, 2 if one uses another dtype."""
    for s in range(meta.shape[0]):
        if meta[s, 2] != 0:
            return 1
    for s in range(meta.shape[0]):
        if meta[s, 1] != elem:
            return 2
    return 0


@_jit
def combine_send_single(bases, lay, me, epoch, rows, src_rank, src_tok, src_slot, elem, corrupt,
                        cs, bsp):
    """Hello, rows back and batch flags of a one-worker combine (bsp: hello last).

    sp: a row holding the sentinel sends an abort hello and returns -(row + 1); else 0.
    """
    world = lay[L_WORLD]
    fmt = lay[L_FMT]
    if fmt == FMT_SP:
        bad = sp_check_rows(rows, lay[L_BB])
        if bad >= 0:
            send_hello(bases, lay, me, epoch, 1, elem, 1)
            return -(bad + 1)
    if not bsp:
        send_hello(bases, lay, me, epoch, 1, elem, 0)
    for d in range(world):
        cs[d] = 0
    send_back(bases, lay, epoch, rows, src_rank, src_tok, src_slot, 0, rows.shape[0], cs)
    if fmt == FMT_SW or fmt == FMT_DC:
        write_batch_flags(bases, lay, 1, me, epoch, 0, cs, corrupt)
    if bsp:
        send_hello(bases, lay, me, epoch, 1, elem, 0)
    return 0


@_jit
def combine_poll_single(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello, got,
                        done, batch, y, spins, hellos_first):
    """Collect hellos and sum the tokens whose rows arrived; returns what is still missing.

    `hellos_first` (bsp): no token is summed before every peer's hello (flag) arrived.
    """
    missing = poll_hello(base, lay, epoch, hello, got, spins if hellos_first else 1)
    if hellos_first and missing:
        return missing
    return missing + reduce_tokens(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut,
                                   hello, 0, idx.shape[0], done, batch, y, spins)


# -- one worker, tensors by address: a call in as few kernel entries as the waits allow ------------
# The one-worker path passes its per-call tensors as raw addresses (`t.data_ptr()`, a fraction
# of a microsecond) and builds the views here: a numpy view of a tensor costs microseconds on
# the Python side. The caller keeps the tensors alive for the call. `res` receives results
# that are not a poll's "still missing" count.
RES_SENDS, RES_META, RES_RECV, RES_ROUTED = 0, 1, 2, 3
#: combine_poll_at: how the fp32 sums reach the output (in place; bf16 rounding; by the caller)
CAST_NONE, CAST_BF16 = 0, 1


@_jit
def dispatch_begin_at(bases, lay, me, epoch, x_addr, num_tokens, rb, idx_addr, top_k, w_addr,
                      expert_order, static, elem, corrupt, cs, bsp, counts, meta, got,
                      out_start, tpe, batch, res):
    """`dispatch_send_single`, then one look at the counts (`dispatch_counts_at`).

    Sets `res[RES_SENDS]` to the send count, or to -(token + 1) after an sp sentinel abort (then
    returns 0 and does nothing more). Returns the sources whose counts are still missing.
    """
    x = carray(u8_ptr(x_addr), (num_tokens, rb))
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    n = dispatch_send_single(bases, lay, me, epoch, x, idx, w, expert_order, static, elem,
                             corrupt, cs, bsp)
    res[RES_SENDS] = n
    if n < 0:
        return 0
    for s in range(got.shape[0]):
        got[s] = 0
    return dispatch_counts_at(bases[me], lay, epoch, counts, meta, got, out_start, tpe, batch,
                              elem, res, 1)


@_jit
def dispatch_counts_at(base, lay, epoch, counts, meta, got, out_start, tpe, batch, elem, res,
                       spins):
    """`poll_counts` of every source; once all arrived, `check_meta` into `res[RES_META]`,
    the offsets and tokens per expert, N into `res[RES_RECV]`, and `batch` reset for the rows.

    Returns the sources still missing (0: done).
    """
    missing = poll_counts(base, lay, epoch, 0, lay[L_WORLD], counts, meta, got, spins)
    if missing:
        return missing
    res[RES_META] = check_meta(meta, elem)
    res[RES_RECV] = offsets(counts, out_start, tpe)
    for s in range(batch.shape[0]):
        batch[s] = 0
    return 0


@_jit
def recv_rows_at(base, lay, epoch, counts, meta, out_start, n, done, batch, x_addr, rb, out_w,
                 ints, spins):
    """`recv_rows` of all `n` rows into the `[n, rb]` bytes at `x_addr`; `ints` `[3, n]` gets
    (source rank, token, slot). Returns the rows still missing."""
    out_x = carray(u8_ptr(x_addr), (n, rb))
    return recv_rows(base, lay, epoch, counts, meta, out_start, 0, n, done, batch, out_x, out_w,
                     ints[0], ints[1], ints[2], spins)


@_jit
def combine_begin_at(bases, lay, me, epoch, rows_addr, n, rb, ints, elem, corrupt, cs, bsp,
                     hello, got, batch, y_addr, num_tokens, hidden):
    """`combine_send_single` of the `[n, rb]` bytes at `rows_addr`, then the receive state
    reset: `hello` -1, `got` and `batch` 0, the fp32 sums `[num_tokens, hidden]` at `y_addr`
    zeroed (after the send: the peers need our rows first). Returns what the send returns."""
    rows = carray(u8_ptr(rows_addr), (n, rb))
    bad = combine_send_single(bases, lay, me, epoch, rows, ints[0], ints[1], ints[2], elem,
                              corrupt, cs, bsp)
    if bad < 0:
        return bad
    for s in range(hello.shape[0]):
        got[s] = 0
        batch[s] = 0
        for i in range(hello.shape[1]):
            hello[s, i] = -1
    y = carray(f32_ptr(y_addr), num_tokens * hidden)
    for i in range(num_tokens * hidden):
        y[i] = 0.0
    return 0


@_jit
def combine_poll_at(base, lay, epoch, idx_addr, w_addr, num_tokens, top_k, weighted, rb, es,
                    ecode, lut, hello, got, done, batch, y_addr, hidden, spins, bsp, elem,
                    cast, out_addr, res):
    """`combine_poll_single` over the routing at `idx_addr`/`w_addr` into the sums at
    `y_addr`; once complete, `check_meta` of the hellos into `res[RES_META]`, the routed slots
    into `res[RES_ROUTED]` and (`cast` == CAST_BF16) the sums rounded into the bf16
    `[num_tokens, hidden]` at `out_addr`.

    Returns what is still missing (0: done).
    """
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    y = carray(f32_ptr(y_addr), (num_tokens, hidden))
    missing = combine_poll_single(base, lay, epoch, idx, w, weighted, rb, es, ecode, lut, hello,
                                  got, done, batch, y, spins, bsp)
    if missing:
        return missing
    res[RES_META] = check_meta(hello, elem)
    routed = 0
    for t in range(num_tokens):
        for k in range(top_k):
            if idx[t, k] >= 0:
                routed += 1
    res[RES_ROUTED] = routed
    if cast == CAST_BF16:
        f32_to_bf16(y, carray(u16_ptr(out_addr), (num_tokens, hidden)))
    return 0


def _warm_up_at(bases, lay, bsp: bool) -> None:
    """Compile (or load) the by-address kernels with the argument types of a real call."""
    base = int(bases[0])
    el = int(lay[L_EL])
    x = np.zeros((1, 8), np.uint8)
    idx = np.zeros((1, 1), np.int64)
    w = np.ones((1, 1), np.float32)
    order = np.arange(el, dtype=np.int64)
    cs, batch, res = np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(4, np.int64)
    counts, out_start = np.zeros((1, el), np.int64), np.zeros((1, el), np.int64)
    meta, got, tpe = np.zeros((1, 3), np.int64), np.zeros(1, np.int8), np.zeros(el, np.int64)
    epoch = 5 if bsp else 4
    x_addr, idx_addr, w_addr = x.ctypes.data, idx.ctypes.data, w.ctypes.data
    dispatch_begin_at(bases, lay, 0, epoch, x_addr, 1, 8, idx_addr, 1, w_addr, order, False, 0,
                      0, cs, bsp, counts, meta, got, out_start, tpe, batch, res)
    dispatch_counts_at(base, lay, epoch, counts, meta, got, out_start, tpe, batch, 0, res, 1)
    n = int(res[RES_RECV])
    ints, wts = np.zeros((3, n), np.int64), np.zeros(n, np.float32)
    out = np.zeros((max(n, 1), 8), np.uint8)
    recv_rows_at(base, lay, epoch, counts, meta, out_start, n, np.zeros(n, np.uint8), batch,
                 out.ctypes.data, 8, wts, ints, 1)
    hello = np.zeros((1, 3), np.int64)
    y = np.zeros((1, 2), np.float32)
    y16 = np.zeros((1, 2), np.uint16)
    combine_begin_at(bases, lay, 0, epoch, out.ctypes.data, n, 8, ints, 0, 0, cs, bsp, hello,
                     got, batch, y.ctypes.data, 1, 2)
    combine_poll_at(base, lay, epoch, idx_addr, w_addr, 1, 1, True, 8, 4, ELEM_F32,
                    np.zeros(1, np.float32), hello, got, np.zeros(1, np.uint8), batch,
                    y.ctypes.data, 2, 1, bsp, 0, CAST_BF16, y16.ctypes.data, res)


def warm_up(lay_of, multi: bool) -> None:
    """Compile (or load from cache) the kernels a call uses, on a private 1-rank region.

    Called at Buffer creation, before the bootstrap barrier, so that JIT time never counts
    against a call's deadline while a peer waits. `lay_of(world=1, ...)` builds a layout.
    """
    lay = lay_of()
    mem = np.zeros(int(lay[L_SIZE]) + 64, np.uint8)
    base = (mem.ctypes.data + 63) // 64 * 64
    bases = np.array([base], np.int64)
    x = np.zeros((1, 8), np.uint8)
    idx = np.zeros((1, 1), np.int64)
    w = np.ones((1, 1), np.float32)
    order = np.arange(lay[L_EL], dtype=np.int64)
    cs = np.zeros(1, np.int64)
    meta = np.zeros((1, 3), np.int64)
    got = np.zeros(1, np.int8)
    rc = np.zeros((1, lay[L_EL]), np.int64)
    out_start = np.zeros((1, lay[L_EL]), np.int64)
    tpe = np.zeros(lay[L_EL], np.int64)
    for epoch, bsp in ((1, False), (2, True)):
        dispatch_send_single(bases, lay, 0, epoch, x, idx, w, order, False, 0, 0, cs, bsp)
        got[:] = 0
        poll_counts(base, lay, epoch, 0, 1, rc, meta, got, 1)
        check_meta(meta, 0)
        n = offsets(rc, out_start, tpe)
        ints = np.zeros((3, n), np.int64)
        recv_rows(base, lay, epoch, rc, meta, out_start, 0, n, np.zeros(n, np.uint8),
                  np.zeros(1, np.int64), np.zeros((n, 8), np.uint8), np.zeros(n, np.float32),
                  ints[0], ints[1], ints[2], 1)
        combine_send_single(bases, lay, 0, epoch, np.zeros((n, 8), np.uint8), ints[0], ints[1],
                            ints[2], 0, 0, cs, bsp)
        hello = np.full((1, 3), -1, np.int64)
        got[:] = 0
        combine_poll_single(base, lay, epoch, idx, w, True, 8, 4, ELEM_F32,
                            np.zeros(1, np.float32), hello, got, np.zeros(1, np.uint8),
                            np.zeros(1, np.int64), np.zeros((1, 2), np.float32), 1, bsp)
        _warm_up_at(bases, lay, bsp)
    if multi:
        send_counts(bases, lay, 0, 3, tpe, 1, 0, 0, 0, 1)
        sends, pos, counts = plan_single(idx, order, False, lay[L_EL])
        send_rows(bases, lay, 0, 3, x, idx, w, sends, pos, counts, cs)
        write_batch_flags(bases, lay, 0, 0, 3, 0, cs, 0)
        poll_hello(base, lay, 3, meta, got, 1)
        send_hello(bases, lay, 0, 3, 1, 0, 0)
        send_back(bases, lay, 3, x, ints[0], ints[1], ints[2], 0, 0, cs)
        reduce_tokens(base, lay, 3, idx, w, True, 8, 4, ELEM_F32, np.zeros(1, np.float32),
                      meta, 0, 0, np.zeros(1, np.uint8), np.zeros(1, np.int64),
                      np.zeros((1, 2), np.float32), 1)
        counter = np.zeros(1, np.int64)
        barrier_arrive(counter.ctypes.data)
        poll_at_least(counter.ctypes.data, 1, 1)
        publish(counter.ctypes.data, 0)
    del mem


@_jit
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
