"""The one-worker path's kernels: a call's sending side in one entry, its waits in few.

With one worker per rank the same dependency order as the pool path's roles runs in one
thread: counts first, then rows, then the wait for peers' counts, offsets, and reordering.
Rows go through the windows as `dispatch`/`combine` lay them out (packed at the call's row
size, one window per source; see `region`), compiled into these entries.
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.plan.fastplan import count_experts, map_worker
from ubep.runtime.shm.atomics import f32_ptr, i64_ptr, u8_ptr, u16_ptr
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.combine import reduce_tokens_mine, send_back_except
from ubep.runtime.shm.kernels.dispatch import offsets, recv_rows_mine, send_rows_keep_mine
from ubep.runtime.shm.kernels.records import FMT_DC, FMT_SP, FMT_SW
from ubep.runtime.shm.kernels.sentinel import sp_check_dispatch, sp_check_rows
from ubep.runtime.shm.kernels.slots import (
    check_meta,
    poll_counts,
    poll_hello,
    send_counts,
    send_hello,
    write_batch_flags,
)
from ubep.runtime.shm.region import L_BB, L_DROWS, L_EL, L_FMT, L_KMAX, L_WORLD


# -- one worker: a call's sending side in one kernel ----------------------------------------------
@jit
def dispatch_send_single(bases, lay, me, epoch, x, idx, weights, rank_of_expert, hop_of_rank,
                         kind, num_hop_classes, elem, cs, bsp, mine):
    """Plan, counts, rows and batch flags of a one-worker dispatch in one call.

    My rows for myself are not written to my window: `mine` notes them
    (`send_rows_keep_mine`) and the receive side copies them from `x`.

    ubep order: counts first, then rows (+ sw/dc batch flags); bsp order: rows, flags, then
    counts (the Send-Flag-and-Count phase). sp: rows are checked for the sentinel first; a
    hit sends an abort in place of the counts and returns -(token + 1). Else the send count.
    """
    world = lay[L_WORLD]
    fmt = lay[L_FMT]
    counts = np.empty(world * lay[L_EL], np.int64)
    count_experts(idx, counts)             # the planner's own pieces, as a pool worker's
    sends, _, pos, _ = map_worker(idx, counts, lay[L_EL], hop_of_rank, rank_of_expert, kind, 1,
                                  num_hop_classes, 0)
    if fmt == FMT_SP:
        bad = sp_check_dispatch(x, weights, sends, lay[L_BB])
        if bad >= 0:
            send_counts(bases, lay, me, epoch, counts, 1, elem, 1, 0, world)
            return -(sends[bad, 0] + 1)
    if not bsp:
        send_counts(bases, lay, me, epoch, counts, 1, elem, 0, 0, world)
    for d in range(world):
        cs[d] = 0
    send_rows_keep_mine(bases, lay, me, epoch, x, idx, weights, sends, pos, counts, cs, mine)
    if fmt == FMT_SW or fmt == FMT_DC:
        write_batch_flags(bases, lay, 0, me, epoch, 0, cs)
    if bsp:
        send_counts(bases, lay, me, epoch, counts, 1, elem, 0, 0, world)
    return sends.shape[0]


@jit
def combine_send_single(bases, lay, me, epoch, rows, src_rank, src_tok, src_slot, elem, cs,
                        bsp):
    """Hello, rows back and batch flags of a one-worker combine (bsp: hello last). Rows
    whose source is me stay where they are (my reduce reads them in place).

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
    send_back_except(bases, lay, epoch, rows, src_rank, src_tok, src_slot, 0, rows.shape[0],
                     cs, me)
    if fmt == FMT_SW or fmt == FMT_DC:
        write_batch_flags(bases, lay, 1, me, epoch, 0, cs)
    if bsp:
        send_hello(bases, lay, me, epoch, 1, elem, 0)
    return 0


@jit
def combine_poll_single(base, lay, epoch, idx, weights, weighted, rb, es, elem, lut, hello, got,
                        done, batch, y, out16, me, row_of_slot, rows_addr, spins, hellos_first):
    """Collect hellos and sum the tokens whose rows arrived; returns what is still missing.

    Sums go to `y`, or rounded to bf16 into `out16` if it has rows (`reduce_tokens_mine`;
    my own experts' rows are read in place at `rows_addr`, `row_of_slot` says which).
    `hellos_first` (bsp): no token is summed before every peer's hello (flag) arrived.
    """
    missing = poll_hello(base, lay, epoch, hello, got, spins if hellos_first else 1)
    if hellos_first and missing:
        return missing
    return missing + reduce_tokens_mine(base, lay, epoch, idx, weights, weighted, rb, es, elem,
                                        lut, hello, 0, idx.shape[0], done, batch, y, out16,
                                        me, row_of_slot, rows_addr, spins)


# -- one worker, tensors by address: a call in as few kernel entries as the waits allow ------------
# The one-worker path passes its per-call tensors as raw addresses (`t.data_ptr()`, a fraction
# of a microsecond) and builds the views here: a numpy view of a tensor costs microseconds on
# the Python side. The caller keeps the tensors alive for the call. `res` receives results
# that are not a poll's "still missing" count.
RES_SENDS, RES_META, RES_RECV, RES_ROUTED = 0, 1, 2, 3
#: combine_poll_at: how the fp32 sums reach the output (in place; bf16 rounding; by the caller)
CAST_NONE, CAST_BF16 = 0, 1
# The path's kept state is one int64 array (`state_words` long) that the kernels take by
# address and view with `state_views`: every array argument costs a Numba call ~70 ns to
# unbox, and these entries took 14-28 arguments (~1 us a call before any work).


def state_words(world: int, el: int) -> int:
    """Length of the one-worker state array (see `state_views`)."""
    return world * (9 + 2 * el) + 4


@jit
def state_views(addr, world, el):
    """The one-worker path's kept state at `addr` (int64 words, `state_words` of them):
    `(cs [W], counts [W, E/P], meta [W, 3], got [W], out_start [W, E/P], batch [W],
    hello [W, 3], res [4])`."""
    p = addr
    cs = carray(i64_ptr(p), world)
    p += 8 * world
    counts = carray(i64_ptr(p), (world, el))
    p += 8 * world * el
    meta = carray(i64_ptr(p), (world, 3))
    p += 24 * world
    got = carray(i64_ptr(p), world)
    p += 8 * world
    out_start = carray(i64_ptr(p), (world, el))
    p += 8 * world * el
    batch = carray(i64_ptr(p), world)
    p += 8 * world
    hello = carray(i64_ptr(p), (world, 3))
    p += 24 * world
    res = carray(i64_ptr(p), 4)
    return cs, counts, meta, got, out_start, batch, hello, res


@jit
def dispatch_begin_at(bases, lay, me, epoch, x_addr, num_tokens, rb, idx_addr, top_k, w_addr,
                      rank_of_expert, hop_of_rank, kind, num_hop_classes, elem, bsp, state,
                      tpe, done_addr, mine_addr):
    """`dispatch_send_single`, then one look at the counts (`dispatch_counts_at`).

    Sets `res[RES_SENDS]` to the send count, or to -(token + 1) after an sp sentinel abort (then
    returns 0 and does nothing more). Returns the sources whose counts are still missing.
    `state` is the address of the kept state (`state_views`), `done_addr` of the rows' done
    flags (uint8, as many as any N), `mine_addr` of `send_rows_keep_mine`'s int64 notes (a
    window's rows).
    """
    world, el = lay[L_WORLD], lay[L_EL]
    cs, _, _, got, _, _, _, res = state_views(state, world, el)
    mine = carray(i64_ptr(mine_addr), lay[L_DROWS])
    x = carray(u8_ptr(x_addr), (num_tokens, rb))
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    n = dispatch_send_single(bases, lay, me, epoch, x, idx, w, rank_of_expert, hop_of_rank, kind,
                             num_hop_classes, elem, cs, bsp, mine)
    res[RES_SENDS] = n
    if n < 0:
        return 0
    for s in range(got.shape[0]):
        got[s] = 0
    return dispatch_counts_at(bases[me], lay, epoch, state, tpe, done_addr, elem, 1)


@jit
def dispatch_counts_at(base, lay, epoch, state, tpe, done_addr, elem, spins):
    """`poll_counts` of every source; once all arrived, `check_meta` into `res[RES_META]`,
    the offsets and tokens per expert, N into `res[RES_RECV]`, and `batch` and the N done
    flags at `done_addr` (kept scratch, as many as any N) reset for the rows.

    Returns the sources still missing (0: done).
    """
    _, counts, meta, got, out_start, batch, _, res = state_views(state, lay[L_WORLD], lay[L_EL])
    missing = poll_counts(base, lay, epoch, 0, lay[L_WORLD], counts, meta, got, spins)
    if missing:
        return missing
    res[RES_META] = check_meta(meta, elem)
    n = offsets(counts, out_start, tpe)
    res[RES_RECV] = n
    for s in range(batch.shape[0]):
        batch[s] = 0
    done = carray(u8_ptr(done_addr), n)
    for i in range(n):
        done[i] = 0
    return 0


@jit
def recv_rows_at(base, lay, epoch, state, n, done_addr, x_addr, rb, out_w, ints, me, mine_addr,
                 src_addr, num_tokens, w_addr, top_k, spins):
    """`recv_rows_mine` of all `n` rows into the `[n, rb]` bytes at `x_addr`; `ints` `[3, n]`
    gets (source rank, token, slot). My rows for myself come from the dispatch's `[num_tokens,
    rb]` rows at `src_addr` and `[num_tokens, top_k]` weights at `w_addr`. Returns the rows
    still missing."""
    _, counts, meta, _, out_start, batch, _, _ = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(done_addr), n)
    mine = carray(i64_ptr(mine_addr), lay[L_DROWS])
    out_x = carray(u8_ptr(x_addr), (n, rb))
    x = carray(u8_ptr(src_addr), (num_tokens, rb))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    return recv_rows_mine(base, lay, epoch, counts, meta, out_start, 0, n, done, batch, out_x,
                          out_w, ints[0], ints[1], ints[2], spins, me, mine, x, w)


@jit
def combine_begin_at(bases, lay, me, epoch, rows_addr, n, rb, ints, elem, bsp, state, done_addr,
                     num_tokens, row_addr):
    """`combine_send_single` of the `[n, rb]` bytes at `rows_addr`, then the receive state
    reset: `hello` -1, `got`, `batch` and `done[:num_tokens]` 0, and `row_of_slot[t*KMAX+k]`
    set to the row of each (t, k) of mine that I received from myself (read in place by the
    reduce). Returns what the send returns. (The sums need no zeroing: `sum_slots` writes
    every element of every token, zeros for an unrouted one.)"""
    kmax = lay[L_KMAX]
    cs, _, _, got, _, batch, hello, _ = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(done_addr), num_tokens)
    row_of_slot = carray(i64_ptr(row_addr), num_tokens * kmax)
    rows = carray(u8_ptr(rows_addr), (n, rb))
    bad = combine_send_single(bases, lay, me, epoch, rows, ints[0], ints[1], ints[2], elem,
                              cs, bsp)
    if bad < 0:
        return bad
    for s in range(hello.shape[0]):
        got[s] = 0
        batch[s] = 0
        for i in range(hello.shape[1]):
            hello[s, i] = -1
    for t in range(num_tokens):
        done[t] = 0
    for i in range(n):
        if ints[0, i] == me:
            row_of_slot[ints[1, i] * kmax + ints[2, i]] = i
    return 0


@jit
def combine_poll_at(base, lay, epoch, idx_addr, w_addr, num_tokens, top_k, weighted, rb, es,
                    ecode, lut, state, done_addr, y_addr, hidden, spins, bsp, elem, cast, out_addr,
                    me, row_addr, rows_addr):
    """`combine_poll_single` over the routing at `idx_addr`/`w_addr` into the sums at
    `y_addr`, or (`cast` == CAST_BF16) rounded token by token into the bf16
    `[num_tokens, hidden]` at `out_addr` (then `y_addr` is not written); once complete,
    `check_meta` of the hellos into `res[RES_META]` and the routed slots into
    `res[RES_ROUTED]`.

    Returns what is still missing (0: done).
    """
    _, _, _, got, _, batch, hello, res = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(done_addr), num_tokens)
    row_of_slot = carray(i64_ptr(row_addr), num_tokens * lay[L_KMAX])
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    if cast == CAST_BF16:
        y = carray(f32_ptr(y_addr), (0, hidden))
        out16 = carray(u16_ptr(out_addr), (num_tokens, hidden))
    else:
        y = carray(f32_ptr(y_addr), (num_tokens, hidden))
        out16 = carray(u16_ptr(out_addr), (0, hidden))
    missing = combine_poll_single(base, lay, epoch, idx, w, weighted, rb, es, ecode, lut, hello,
                                  got, done, batch, y, out16, me, row_of_slot, rows_addr, spins,
                                  bsp)
    if missing:
        return missing
    res[RES_META] = check_meta(hello, elem)
    routed = 0
    for t in range(num_tokens):
        for k in range(top_k):
            if idx[t, k] >= 0:
                routed += 1
    res[RES_ROUTED] = routed
    return 0


