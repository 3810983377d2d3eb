"""Numba kernels of the direct (one-copy) variant: counts first, then rows to their final place.

Once every rank's per-expert counts are known, the row of (my token t, slot k) has a fixed
place in its destination's expert-major output, so the sender copies it there and nowhere
else; combine then reads the expert outputs where they lie. The rules of `kernels/__init__.py`
hold: flags are read with `load_acquire`, and the flag word is release-stored after the row
it guards (here: the row's meta word, which carries the epoch). A row is a payload of its
own, so it is copied by memcpy (`memcpy_at`: string stores, no read of the lines they
overwrite) and a `store_fence` orders it before its meta word.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.runtime.shm.atomics import (
    cpu_pause,
    f32_ptr,
    i64_ptr,
    load_acquire,
    memcpy_at,
    store_fence,
    store_release,
    u16_ptr,
)
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.combine import sum_slots
from ubep.runtime.shm.kernels.local import poll_words_at_least
from ubep.runtime.shm.kernels.slots import poll_slots
from ubep.runtime.shm.region import (
    D_COMB_OFF,
    D_COUNTS_OFF,
    D_CW,
    D_META_OFF,
    D_READY_OFF,
    DC_ELEM,
    DC_RECV,
    DC_STATUS,
    DC_TOKENS,
    DR_ELEM,
    DR_EPOCH,
    DR_OFFSET,
    DR_STATUS,
)

_EPOCH_MASK = 0x7FFFFFFF


#: elements of a token summed at once (`sum_slots`): 2 KiB of fp32, stays in L1
SUM_CHUNK = 512


@jit
def publish_counts(base, dlay, epoch, idx, num_experts, elem, roff):
    """Count my slots per global expert into my own count slot, with the byte offset `roff`
    of the area my rows go to this call; release its epoch last."""
    cw = dlay[D_CW]
    slot = base + dlay[D_COUNTS_OFF] + (epoch & 1) * cw * 8
    w = carray(i64_ptr(slot), cw)
    for e in range(num_experts):
        w[e] = 0
    t_n, k_n = idx.shape
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e >= 0:
                w[e] += 1
    w[num_experts + DC_ELEM] = elem
    w[num_experts + DC_TOKENS] = t_n
    w[num_experts + DC_STATUS] = 0
    w[num_experts + DC_RECV] = roff
    store_release(slot + (cw - 1) * 8, epoch)


@jit
def gather_counts(bases, dlay, epoch, counts, tails, got, spins):
    """Read every rank's count slot of `epoch` into `counts` `[world, E]` and `tails`
    `[world, 4]` (the `DC_*` words: dtype code, T, status, where its rows go); return how
    many ranks lack."""
    world = counts.shape[0]
    cw = dlay[D_CW]
    addrs = bases + dlay[D_COUNTS_OFF] + (epoch & 1) * cw * 8
    return poll_slots(addrs, 0, world, cw - 1, epoch, counts, tails, got, spins)


@jit
def place_rows(counts, me, el, idx, pos, tokens_per_expert, src_rank):
    """Where every row goes, from the count matrix; returns N, the rows I receive.

    `pos[t, k]`: the output row of my (t, k) at its destination (-1 if not routed):
    the destination's expert-major order is (local expert, source rank, source token).
    `tokens_per_expert` `[E/P]` and `src_rank` (first N entries) describe what I receive.
    """
    world, e_n = counts.shape
    first = np.empty(e_n, np.int64)        # my first row at expert e's rank
    for r in range(world):
        row = 0
        for j in range(el):
            e = r * el + j
            for s in range(world):
                if s == me:
                    first[e] = row
                if r == me:
                    for i in range(counts[s, e]):
                        src_rank[row + i] = s
                row += counts[s, e]
    n = 0
    for j in range(el):
        c = 0
        for s in range(world):
            c += counts[s, me * el + j]
        tokens_per_expert[j] = c
        n += c
    t_n, k_n = idx.shape
    for t in range(t_n):
        for k in range(k_n):
            e = idx[t, k]
            if e < 0:
                pos[t, k] = -1
            else:
                pos[t, k] = first[e]
                first[e] += 1
    return n


@jit
def send_rows_direct(bases, dlay, epoch, x_addr, rb, idx, weights, pos, el, t_lo, t_hi, me,
                     dst, src_tok, src_slot, wts, tails):
    """Copy my rows of tokens [t_lo, t_hi) to their final place (in the area each
    destination named in its count slot, `tails[d, DC_RECV]`); then each row's meta word.

    If `dst` is not 0 (`direct="owned"`: my received rows go to the private `[N, rb]` bytes
    at `dst`), a row for my own experts is copied there straight from `x` and its origin
    written into `src_tok`/`src_slot`/`wts` (no meta word: `recv_meta` skips it).
    """
    meta_off = dlay[D_META_OFF]
    k_n = idx.shape[1]
    ep = np.int64(epoch & _EPOCH_MASK) << np.int64(32)
    wbits = weights.view(np.uint32)
    for t in range(t_lo, t_hi):
        src = x_addr + t * rb
        for k in range(k_n):
            e = idx[t, k]
            if e < 0:
                continue
            d = e // el
            row = pos[t, k]
            if dst != 0 and d == me:
                memcpy_at(dst + row * rb, src, rb)
                src_slot[row] = k
                wts[row] = weights[t, k]
                src_tok[row] = t
                continue
            base = bases[d]
            memcpy_at(base + tails[d, DC_RECV] + row * rb, src, rb)
            store_fence()           # the row before its meta word, string stores included
            m = base + meta_off + row * 16
            carray(i64_ptr(m), 1)[0] = np.int64(t) | (np.int64(k) << np.int64(32))
            store_release(m + 8, ep | np.int64(wbits[t, k]))


@jit
def recv_meta(base, dlay, epoch, lo, hi, src_tok, src_slot, wts, dst, roff, rb, spins):
    """Wait for received rows [lo, hi) (their meta words hold `epoch`); decode their metas,
    and, if `dst` is not 0, copy each row out of my area at byte `roff` to row i of the
    `[N, rb]` bytes at `dst` as soon as its meta word is seen (`direct="owned"` when the
    rows could not land in a tensor lent to the caller: the copy out overlaps the rows still
    coming).

    `src_tok[lo:hi]` must hold -1 on the first call of a dispatch: a decoded row holds its
    token (>= 0) and is neither decoded nor copied again. Returns how many rows are still
    missing (0: all arrived, decoded and copied).
    """
    meta = base + dlay[D_META_OFF]
    area = base + roff
    ep = np.int64(epoch & _EPOCH_MASK)
    wv = wts.view(np.uint32)
    missing = 0
    first = lo                               # rows below `first` are decoded
    for _ in range(max(spins, 1)):
        missing = 0
        for i in range(first, hi):
            if src_tok[i] >= 0:
                if missing == 0:
                    first = i + 1
                continue
            v = load_acquire(meta + i * 16 + 8)
            if (v >> np.int64(32)) != ep:
                missing += 1
                continue
            if missing == 0:
                first = i + 1
            if dst != 0:
                memcpy_at(dst + i * rb, area + i * rb, rb)
            ts = carray(i64_ptr(meta + i * 16), 1)[0]
            src_slot[i] = ts >> np.int64(32)
            wv[i] = np.uint32(v & np.int64(0xFFFFFFFF))
            src_tok[i] = ts & np.int64(0xFFFFFFFF)
        if missing == 0:
            return 0
        cpu_pause()
    return missing


@jit
def publish_ready(base, dlay, epoch, elem, offset):
    """Combine: my expert outputs of `epoch` lie at byte `offset` of my region."""
    r = base + dlay[D_READY_OFF]
    w = carray(i64_ptr(r), 4)
    w[DR_ELEM] = elem
    w[DR_OFFSET] = offset
    w[DR_STATUS] = 0
    store_release(r + DR_EPOCH * 8, epoch)


@jit
def reduce_direct(bases, dlay, epoch, idx, weights, weighted, pos, el, rb, es, dtype_code,
                  ecode, lut, t_lo, t_hi, ready, done, y, out16, me, own, spins):
    """Sum tokens [t_lo, t_hi) from the expert outputs where they lie, each as soon as every
    rank holding one of its rows has published them; return tokens missing.

    Each token is summed in slot order (as the reference, `sum_slots`) into `y[t]`, or, if
    `out16` has rows, only rounded into `out16[t]` in the rows' 16-bit format (bf16, fp16).
    `ready[r]`: -1 unknown, else the byte offset of rank r's outputs. `dtype_code` is my
    outputs' dtype (every rank must agree), `ecode`/`lut` how to read it as fp32 (see
    `kernels.sum_slots`). A rank that disagrees returns -(r + 1) (the caller names it). If
    `own` is not 0, rows of my own experts (rank `me`) are read from my expert outputs at
    `own` (they were not copied into the combine area: only peers need that).
    """
    world = bases.shape[0]
    k_n = idx.shape[1]
    rounded = out16.shape[0] > 0
    epb = SUM_CHUNK
    srcs = np.empty(k_n, np.int64)
    blks = np.full(k_n, epb * es, np.int64)      # rows lie contiguous
    wgts = np.empty(k_n, np.float32)
    acc = np.empty(epb, np.float32)
    no_y = np.empty(0, np.float32)
    no_out = np.empty(0, np.uint16)
    remaining = 0
    for _ in range(max(spins, 1)):
        for r in range(world):
            if ready[r] < 0:
                a = bases[r] + dlay[D_READY_OFF]
                if load_acquire(a + DR_EPOCH * 8) == epoch:
                    w = carray(i64_ptr(a), 4)
                    if w[DR_ELEM] != dtype_code or w[DR_STATUS] != 0:
                        return -(r + 1)
                    ready[r] = w[DR_OFFSET]
        remaining = 0
        for t in range(t_lo, t_hi):
            if done[t]:
                continue
            ok = True
            for k in range(k_n):
                e = idx[t, k]
                if e >= 0 and ready[e // el] < 0:
                    ok = False
                    break
            if not ok:
                remaining += 1
                continue
            m = 0
            for k in range(k_n):
                e = idx[t, k]
                if e < 0:
                    continue
                r = e // el
                if r == me and own != 0:
                    srcs[m] = own + pos[t, k] * rb
                else:
                    srcs[m] = bases[r] + ready[r] + pos[t, k] * rb
                wgts[m] = weights[t, k] if weighted else np.float32(1.0)
                m += 1
            if rounded:
                sum_slots(srcs, blks, wgts, m, epb, es, ecode, lut, acc, no_y, out16[t])
            else:
                sum_slots(srcs, blks, wgts, m, epb, es, ecode, lut, acc, y[t], no_out)
            done[t] = 1
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining


# -- one worker: the whole call in as few kernel entries as possible ------------------------------
@jit
def dispatch_begin(bases, dlay, me, epoch, idx, num_experts, elem, roff, counts, tails, got,
                   spins):
    """Publish my counts (my rows go to byte `roff` of my region), then a first look at
    everyone's; returns how many ranks lack."""
    publish_counts(bases[me], dlay, epoch, idx, num_experts, elem, roff)
    for s in range(got.shape[0]):
        got[s] = 0
    return gather_counts(bases, dlay, epoch, counts, tails, got, spins)


@jit
def dispatch_rows(bases, dlay, me, epoch, elem, tails, counts, el, idx, weights, pos, tpe, ints,
                  wts, x_addr, rb, dst, spins):
    """With every rank's counts: place, send all my rows, a first look for the rows I receive
    (copied out to `dst` as they arrive if `dst` is not 0, see `recv_meta`).

    Returns (N, rows still missing), or (-1, rank) if that rank dispatches another dtype.
    `ints[0]` gets each received row's source rank, `ints[1:]` (token, slot) as they arrive.
    """
    for s in range(tails.shape[0]):
        if tails[s, DC_ELEM] != elem:
            return -1, s
    n = place_rows(counts, me, el, idx, pos, tpe, ints[0])
    for i in range(n):
        ints[1, i] = -1
    send_rows_direct(bases, dlay, epoch, x_addr, rb, idx, weights, pos, el, 0, idx.shape[0], me,
                     dst, ints[1], ints[2], wts, tails)
    return n, recv_meta(bases[me], dlay, epoch, 0, n, ints[1], ints[2], wts, dst,
                        tails[me, DC_RECV], rb, spins)


@jit
def combine_begin(bases, dlay, me, epoch, dtype_code, offset, copy_src, copy_n, src_rank, idx,
                  weights, weighted, pos, el, rb, es, ecode, lut, ready, done, y, out16, spins):
    """Copy my expert outputs in (if `copy_n` rows: those peers read), publish them, a first
    round of sums (my own rows read at `copy_src`)."""
    if copy_n > 0:
        copy_rows_for_peers(bases[me] + dlay[D_COMB_OFF], copy_src, rb, src_rank, me, copy_n)
    publish_ready(bases[me], dlay, epoch, dtype_code, offset)
    for r in range(ready.shape[0]):
        ready[r] = -1
    return reduce_direct(bases, dlay, epoch, idx, weights, weighted, pos, el, rb, es,
                         dtype_code, ecode, lut, 0, idx.shape[0], ready, done, y, out16, me,
                         copy_src if copy_n > 0 else 0, spins)


@jit
def copy_rows_for_peers(dst_addr, src_addr, rb, src_rank, me, n):
    """Rows i < n of `rb` bytes from `src_addr` to `dst_addr` whose source rank is not `me`
    (a rank's own rows are summed where they lie; only peers read the combine area).
    Rows of one source lie together within an expert, so runs are copied whole."""
    i = 0
    while i < n:
        if src_rank[i] == me:
            i += 1
            continue
        j = i + 1
        while j < n and src_rank[j] != me:
            j += 1
        memcpy_at(dst_addr + i * rb, src_addr + i * rb, (j - i) * rb)
        i = j
    store_fence()                   # every row before the caller publishes them


# -- one worker, routing and outputs by address ---------------------------------------------------
# As the one-worker path of the two-copy protocol (`staged/kernels.py`): per-call tensors reach
# the kernels as raw addresses (`data_ptr()`, a fraction of a microsecond where a numpy view of a
# tensor costs a microsecond or more); the caller keeps them alive for the call.
@jit
def dispatch_begin_at(bases, dlay, me, epoch, idx_addr, t_n, k_n, num_experts, elem, roff,
                      counts, tails, got, spins):
    """`dispatch_begin` of the `[t_n, k_n]` int64 routing at `idx_addr`; returns (ranks whose
    counts lack, N = `rows_for(counts, me)` once none lacks, else -1)."""
    idx = carray(i64_ptr(idx_addr), (t_n, k_n))
    left = dispatch_begin(bases, dlay, me, epoch, idx, num_experts, elem, roff, counts, tails,
                          got, spins)
    return left, (-1 if left else rows_for(counts, me))


@jit
def rows_for(counts, me):
    """N, the rows rank `me` receives: every rank's count for each of my experts."""
    world, e_n = counts.shape
    el = e_n // world
    n = 0
    for s in range(world):
        for e in range(me * el, (me + 1) * el):
            n += counts[s, e]
    return n


@jit
def dispatch_rows_at(bases, dlay, me, epoch, elem, tails, counts, el, idx_addr, w_addr, t_n,
                     k_n, pos_addr, tpe, ints, wts, x_addr, rb, dst, spins):
    """`dispatch_rows` of the routing at `idx_addr`/`w_addr`; `pos` `[t_n, k_n]` at
    `pos_addr`; received rows go to `dst` unless it is 0."""
    idx = carray(i64_ptr(idx_addr), (t_n, k_n))
    w = carray(f32_ptr(w_addr), (t_n, k_n))
    pos = carray(i64_ptr(pos_addr), (t_n, k_n))
    return dispatch_rows(bases, dlay, me, epoch, elem, tails, counts, el, idx, w, pos, tpe, ints,
                         wts, x_addr, rb, dst, spins)


@jit
def dispatch_rows_own(bases, dlay, me, epoch, elem, tails, counts, el, idx_addr, w_addr, t_n,
                      k_n, pos, tpe, ints, wts, x_addr, rb, dst, spins):
    """`dispatch_rows_at` with `pos` a fresh flat int64 array of at least `t_n * k_n` (one the
    handle keeps, `direct="owned"`); returns (N or -1, missing, `pos`'s address), so the
    caller needs no Python call to learn where `pos` lies."""
    idx = carray(i64_ptr(idx_addr), (t_n, k_n))
    w = carray(f32_ptr(w_addr), (t_n, k_n))
    p = pos[:t_n * k_n].reshape((t_n, k_n))
    n, missing = dispatch_rows(bases, dlay, me, epoch, elem, tails, counts, el, idx, w, p, tpe,
                               ints, wts, x_addr, rb, dst, spins)
    return n, missing, pos.ctypes.data


@jit
def reduce_direct_at(bases, dlay, epoch, idx_addr, w_addr, t_n, k_n, weighted, pos_addr, el,
                     rb, es, dtype_code, ecode, lut, ready, done, y_addr, out_addr, hidden, me,
                     own, spins):
    """`reduce_direct` of all `t_n` tokens, by address: sums into the fp32 `[t_n, hidden]` at
    `y_addr`, or, if `out_addr` is not 0, rounded into the `[t_n, hidden]` there in the
    rows' 16-bit format (bf16, or fp16 where `ecode` is `ELEM_F16`)."""
    idx = carray(i64_ptr(idx_addr), (t_n, k_n))
    w = carray(f32_ptr(w_addr), (t_n, k_n))
    pos = carray(i64_ptr(pos_addr), (t_n, k_n))
    if out_addr != 0:
        y = carray(f32_ptr(y_addr), (0, hidden))
        out16 = carray(u16_ptr(out_addr), (t_n, hidden))
    else:
        y = carray(f32_ptr(y_addr), (t_n, hidden))
        out16 = carray(u16_ptr(out_addr), (0, hidden))
    return reduce_direct(bases, dlay, epoch, idx, w, weighted, pos, el, rb, es, dtype_code,
                         ecode, lut, 0, t_n, ready, done, y, out16, me, own, spins)


@jit
def combine_begin_at(bases, dlay, me, epoch, dtype_code, offset, copy_src, copy_n, src_rank,
                     idx_addr, w_addr, t_n, k_n, weighted, pos_addr, el, rb, es, ecode, lut,
                     ready, done, y_addr, out_addr, hidden, spins, done_mine, done_first):
    """`combine_begin` by address (see `reduce_direct_at`); `done[:t_n]` is reset here.

    Returns (tokens missing or -(r + 1), ranks not done reading mine): once every token is
    summed, `done_reading(done_mine, done_first, ...)` runs in this same entry (second value
    >= 0); while tokens are missing it has not run (-1)."""
    if copy_n > 0:
        copy_rows_for_peers(bases[me] + dlay[D_COMB_OFF], copy_src, rb, src_rank, me, copy_n)
    publish_ready(bases[me], dlay, epoch, dtype_code, offset)
    for r in range(ready.shape[0]):
        ready[r] = -1
    for t in range(t_n):
        done[t] = 0
    left = reduce_direct_at(bases, dlay, epoch, idx_addr, w_addr, t_n, k_n, weighted, pos_addr,
                            el, rb, es, dtype_code, ecode, lut, ready, done, y_addr, out_addr,
                            hidden, me, copy_src if copy_n > 0 else 0, spins)
    if left != 0:
        return left, -1
    return 0, done_reading(done_mine, done_first, bases.shape[0], epoch, spins)


@jit
def done_reading(mine, first, world, epoch, spins):
    """Release `epoch` into my done word on every rank (`mine` `[world]` addresses), then look
    at every rank's word on mine (`world` words at `first`); how many have not reached it."""
    for r in range(mine.shape[0]):
        store_release(mine[r], epoch)
    return poll_words_at_least(first, world, epoch, spins)
