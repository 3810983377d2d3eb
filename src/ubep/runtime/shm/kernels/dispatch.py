"""Dispatch rows: into the destination's window for (source, expert), then into place.

The sender writes each row into its destination's window at (my rank, expert, window
position); the receiver computes the offsets of every (source, expert) run from the counts
(CalCumSum) and reorders each row into the expert-major output once it is seen complete.
"""

from __future__ import annotations

import numpy as np

from ubep.runtime.shm.atomics import cpu_pause
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.records import (
    FMT_DC,
    FMT_SP,
    FMT_SW,
    FMT_TFF,
    blocks_ready,
    copy_bytes,
    markers_checksum,
    num_blocks,
    read_record,
    rearm,
    write_record,
)
from ubep.runtime.shm.kernels.slots import batch_complete
from ubep.runtime.shm.region import (
    L_BB,
    L_DROWS,
    L_DSTRIDE,
    L_DWIN_OFF,
    L_EL,
    L_FMT,
    L_PPB,
    L_WORLD,
)

#: recv_rows: consecutive not-yet-arrived rows of a source checked per round
MAX_MISSES = 8


@jit
def window(lay, epoch, src, stride):
    """Byte offset of source `src`'s dispatch window in a region for `epoch`: one fixed
    half per epoch parity (sized for the widest rows), the call's records packed at `stride`
    within it (see `region`)."""
    half = (epoch & 1) * lay[L_WORLD] * lay[L_DROWS] * lay[L_DSTRIDE]
    return lay[L_DWIN_OFF] + half + src * lay[L_DROWS] * stride


@jit
def send_rows(bases, lay, me, epoch, x, idx, weights, sends, window_pos, counts, cs):
    """Write each send's record (meta + row) into its destination's window for me.

    `window_pos` is the row among my rows for that expert; rows of one destination are laid
    out expert by expert. Adds each destination's checksum term to `cs[d]`.
    """
    send_rows_keep_mine(bases, lay, me, epoch, x, idx, weights, sends, window_pos, counts, cs,
                        np.empty(0, np.int64))


@jit
def send_rows_keep_mine(bases, lay, me, epoch, x, idx, weights, sends, window_pos, counts, cs,
                        mine):
    """`send_rows`, except, if `mine` has room, the rows I send to myself: for those only
    `mine[row] = t * K + k` is noted for each of my window rows (the receive side copies
    them from `x` in place: `recv_rows_mine`), a copy and flags saved per row."""
    keep = mine.shape[0] > 0
    k_n = idx.shape[1]
    world, el = lay[L_WORLD], lay[L_EL]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
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
    stride = nb * bb                         # this call's records, packed (see `region`)
    win = window(lay, epoch, me, stride)
    for i in range(sends.shape[0]):
        t, k, d = sends[i, 0], sends[i, 1], sends[i, 2]
        row = first[idx[t, k]] + window_pos[i]
        if keep and d == me:
            mine[row] = t * k_n + k
            continue
        head_i[0] = t
        head_i[1] = k
        head_f[2] = weights[t, k]
        dst = bases[d] + win + row * stride
        cs[d] += write_record(dst, bb, ppb, fmt, head, 16, x[t], rb, epoch, row * nb)



@jit
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



@jit
def offsets_range(counts, e_lo, e_hi, out_start, tokens_per_expert):
    """CalCumSum for local experts [e_lo, e_hi) only (a count worker's share): their
    `out_start` and `tokens_per_expert`; returns N (rows received, all experts).

    The share's base (rows of the experts before it) is summed from `counts` directly, so the
    count workers need not wait for each other's prefix.
    """
    world, el = counts.shape
    n = 0
    for e in range(e_lo):
        for s in range(world):
            n += counts[s, e]
    for e in range(e_lo, e_hi):
        tokens_per_expert[e] = 0
        for s in range(world):
            out_start[s, e] = n
            n += counts[s, e]
            tokens_per_expert[e] += counts[s, e]
    for e in range(e_hi, el):
        for s in range(world):
            n += counts[s, e]
    return n


@jit
def recv_rows(base, lay, epoch, counts, meta, out_start, lo, hi, done, batch, out_x, out_w,
              out_rank, out_tok, out_slot, spins):
    """Reorder received rows [lo, hi) (source-major item order) into the expert-major output.

    A row is taken once its blocks are seen complete (tff flags / sp markers) or its source's
    batch is complete (sw) and verified (dc). `batch[s]`: 0 unknown, 1 complete, -1 dc
    checksum mismatch seen (retried). Returns the rows of [lo, hi) still missing.
    """
    return recv_rows_mine(base, lay, epoch, counts, meta, out_start, lo, hi, done, batch, out_x,
                          out_w, out_rank, out_tok, out_slot, spins, -1,
                          np.empty(0, np.int64), out_x[:0], out_w[:0].reshape((0, 1)))


@jit
def recv_rows_mine(base, lay, epoch, counts, meta, out_start, lo, hi, done, batch, out_x, out_w,
                   out_rank, out_tok, out_slot, spins, me, mine, x, weights):
    """`recv_rows`; the rows of source `me` (>= 0) were not written to my window
    (`send_rows_keep_mine`): window row q of mine is my (t, k) = divmod(mine[q], K), copied
    from `x` `[T, rb]` with its weight from `weights` `[T, K]`, no flags to wait for."""
    k_n = weights.shape[1]
    world, el = lay[L_WORLD], lay[L_EL]
    bb, ppb, fmt = lay[L_BB], lay[L_PPB], lay[L_FMT]
    rb = out_x.shape[1]
    nb = num_blocks(16 + rb, ppb)
    stride = nb * bb                         # as the senders packed them
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
            if s == me:
                q = 0
                for e in range(el):
                    for r in range(counts[s, e]):
                        gi = g + q
                        if lo <= gi < hi and not done[gi]:
                            t = mine[q] // k_n
                            k = mine[q] - t * k_n
                            o = out_start[s, e] + r
                            copy_bytes(out_x.ctypes.data + o * rb, x.ctypes.data + t * rb, rb)
                            out_tok[o] = t
                            out_slot[o] = k
                            out_w[o] = weights[t, k]
                            out_rank[o] = s
                            done[gi] = 1
                        q += 1
                g += r_s
                continue
            win = base + window(lay, epoch, s, stride)
            if fmt == FMT_SW or fmt == FMT_DC:
                if batch[s] != 1:
                    ok, total = batch_complete(base, lay, False, epoch, s, meta[s, 0])
                    if ok and fmt == FMT_DC:
                        got_cs = np.int64(0)
                        for q in range(r_s):
                            got_cs += markers_checksum(win + q * stride, nb, bb, q * nb)
                        ok = got_cs == total
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
                        elif (fmt == FMT_TFF or fmt == FMT_SP) and not blocks_ready(
                                src, nb, bb, fmt, epoch):
                            remaining += 1
                            misses += 1
                        else:
                            misses = 0
                            o = out_start[s, e] + r
                            read_record(src, bb, ppb, head, 16, out_x[o], rb)
                            out_tok[o] = head_i[0]
                            out_slot[o] = head_i[1]
                            out_w[o] = head_f[2]
                            out_rank[o] = s
                            if fmt == FMT_SP:
                                rearm(src, nb, bb)
                            done[gi] = 1
                    q += 1
            g += r_s
        if remaining == 0:
            return 0
        cpu_pause()
    return remaining


