"""The one-worker path's kernels: a call's sending side in one entry, its waits in few.

With one worker per rank the same dependency order as the pool path's roles runs in one
thread: counts first, then rows, then the wait for peers' counts, offsets, and reordering.
Rows go through the windows as `dispatch`/`combine` lay them out (packed at the call's row
size, one window per source; see `region`), compiled into these entries; a token's rows are
summed by `combine.sum_slots` (Numba's cache sees only this file: edit it when that changes).
"""

from __future__ import annotations

import numpy as np
from numba import carray

from ubep.native.layout import CAST_16
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
from ubep.runtime.shm.region import L_BB, L_DROWS, L_EL, L_FMT, L_KMAX, L_LEN, L_WORLD


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

    Sums go to `y`, or rounded to 16 bits into `out16` if it has rows (`reduce_tokens_mine`;
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
#: combine_poll_at: how the fp32 sums reach the output (in place; rounded to the rows' 16-bit
#: format, bf16 or fp16; by the caller)
# The path's kept state is one int64 array (`state_words` long) that the kernels take by
# address: first what stays the same for the Buffer's life (`K_*`: addresses of the region
# layout, the regions, the kept flags and notes, the planner's mapper arrays; rank, mode),
# then the per-call words (`state_views`). Every argument costs a Numba call ~40 ns to
# unbox, an array ~200-300 ns: the entries took 14-28 arguments, 2-5 of them arrays, which
# were the same on every call.
(K_BASE, K_BASES, K_LAY, K_ME, K_BSP, K_DONE_ROWS, K_DONE_TOKENS, K_MINE, K_ROW_OF_SLOT,
 K_ROE, K_NROE, K_HOP, K_NHOP_RANKS, K_KIND, K_NHOP) = range(15)
NK = 15


def state_words(world: int, el: int) -> int:
    """Length of the one-worker state array (`K_*` words, then `state_views`)."""
    return NK + world * (9 + 2 * el) + 4


def state_array(world: int, el: int, *, base: int, bases: np.ndarray, lay: np.ndarray, me: int,
                bsp: bool, done_rows: np.ndarray, done_tokens: np.ndarray, mine: np.ndarray,
                row_of_slot: np.ndarray, rank_of_expert: np.ndarray, hop_of_rank: np.ndarray,
                kind: int, num_hop_classes: int) -> np.ndarray:
    """The state array of a one-worker path, its `K_*` words filled in. The caller keeps every
    array passed here alive (and unmoved) as long as the state is used."""
    st = np.zeros(state_words(world, el), np.int64)
    for a, dt in ((bases, np.int64), (lay, np.int64), (done_rows, np.uint8),
                  (done_tokens, np.uint8), (mine, np.int64), (row_of_slot, np.int64),
                  (rank_of_expert, np.int64), (hop_of_rank, np.int64)):
        if a.dtype != dt or not a.flags.c_contiguous:
            raise TypeError(f"state_array: expected a contiguous {np.dtype(dt)} array")
    st[:NK] = [base, bases.ctypes.data, lay.ctypes.data, me, int(bsp), done_rows.ctypes.data,
               done_tokens.ctypes.data, mine.ctypes.data, row_of_slot.ctypes.data,
               rank_of_expert.ctypes.data, rank_of_expert.shape[0], hop_of_rank.ctypes.data,
               hop_of_rank.shape[0], kind, num_hop_classes]
    return st


@jit
def consts(addr):
    """The `K_*` words of the state at `addr`, and the layout and region addresses they
    point at: `(k, lay, bases)`."""
    k = carray(i64_ptr(addr), NK)
    lay = carray(i64_ptr(k[K_LAY]), L_LEN)
    bases = carray(i64_ptr(k[K_BASES]), lay[L_WORLD])
    return k, lay, bases


@jit
def state_views(addr, world, el):
    """The one-worker path's per-call state at `addr` (after its `NK` constant words):
    `(cs [W], counts [W, E/P], meta [W, 3], got [W], out_start [W, E/P], batch [W],
    hello [W, 3], res [4])`."""
    p = addr + 8 * NK
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
def dispatch_begin_at(state, epoch, x_addr, num_tokens, rb, idx_addr, top_k, w_addr, elem, tpe,
                      spins):
    """`dispatch_send_single`, then the counts polled for `spins` rounds
    (`dispatch_counts_at`: the Python path looks once, the door spins as the direct path's).

    Sets `res[RES_SENDS]` to the send count, or to -(token + 1) after an sp sentinel abort (then
    returns 0 and does nothing more). Returns the sources whose counts are still missing.
    `state` is the address of the kept state (`state_array`); my rows for myself are noted
    in its `K_MINE` array (a window's rows, `send_rows_keep_mine`).
    """
    k, lay, bases = consts(state)
    world, el = lay[L_WORLD], lay[L_EL]
    cs, _, _, got, _, _, _, res = state_views(state, world, el)
    mine = carray(i64_ptr(k[K_MINE]), lay[L_DROWS])
    roe = carray(i64_ptr(k[K_ROE]), k[K_NROE])
    hop = carray(i64_ptr(k[K_HOP]), k[K_NHOP_RANKS])
    x = carray(u8_ptr(x_addr), (num_tokens, rb))
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    n = dispatch_send_single(bases, lay, k[K_ME], epoch, x, idx, w, roe, hop, k[K_KIND],
                             k[K_NHOP], elem, cs, k[K_BSP] != 0, mine)
    res[RES_SENDS] = n
    if n < 0:
        return 0
    for s in range(got.shape[0]):
        got[s] = 0
    return dispatch_counts_at(state, epoch, tpe, elem, spins)


@jit
def dispatch_counts_at(state, epoch, tpe, elem, spins):
    """`poll_counts` of every source; once all arrived, `check_meta` into `res[RES_META]`,
    the offsets and tokens per expert, N into `res[RES_RECV]`, and `batch` and the N rows'
    done flags (`K_DONE_ROWS`, kept scratch, as many as any N) reset for the rows.

    Returns the sources still missing (0: done).
    """
    k, lay, _ = consts(state)
    _, counts, meta, got, out_start, batch, _, res = state_views(state, lay[L_WORLD], lay[L_EL])
    missing = poll_counts(k[K_BASE], lay, epoch, 0, lay[L_WORLD], counts, meta, got, spins)
    if missing:
        return missing
    res[RES_META] = check_meta(meta, elem)
    n = offsets(counts, out_start, tpe)
    res[RES_RECV] = n
    for s in range(batch.shape[0]):
        batch[s] = 0
    done = carray(u8_ptr(k[K_DONE_ROWS]), n)
    for i in range(n):
        done[i] = 0
    return 0


@jit
def recv_rows_at(state, epoch, n, x_addr, rb, out_w, ints, src_addr, num_tokens, w_addr, top_k,
                 spins):
    """`recv_rows_mine` of all `n` rows into the `[n, rb]` bytes at `x_addr`; `ints` `[3, n]`
    gets (source rank, token, slot). My rows for myself come from the dispatch's `[num_tokens,
    rb]` rows at `src_addr` and `[num_tokens, top_k]` weights at `w_addr`. Returns the rows
    still missing."""
    k, lay, _ = consts(state)
    _, counts, meta, _, out_start, batch, _, _ = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(k[K_DONE_ROWS]), n)
    mine = carray(i64_ptr(k[K_MINE]), lay[L_DROWS])
    out_x = carray(u8_ptr(x_addr), (n, rb))
    x = carray(u8_ptr(src_addr), (num_tokens, rb))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    return recv_rows_mine(k[K_BASE], lay, epoch, counts, meta, out_start, 0, n, done, batch,
                          out_x, out_w, ints[0], ints[1], ints[2], spins, k[K_ME], mine, x, w)


@jit
def combine_begin_at(state, epoch, rows_addr, n, rb, ints, elem, num_tokens):
    """`combine_send_single` of the `[n, rb]` bytes at `rows_addr`, then the receive state
    reset: `hello` -1, `got`, `batch` and the tokens' done flags (`K_DONE_TOKENS`) 0, and
    `row_of_slot[t*KMAX+k]` (`K_ROW_OF_SLOT`) set to the row of each (t, k) of mine that I
    received from myself (read in place by the reduce). Returns what the send returns. (The
    sums need no zeroing: `sum_slots` writes every element of every token, zeros for an
    unrouted one.)"""
    k, lay, bases = consts(state)
    me, kmax = k[K_ME], lay[L_KMAX]
    cs, _, _, got, _, batch, hello, _ = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(k[K_DONE_TOKENS]), num_tokens)
    row_of_slot = carray(i64_ptr(k[K_ROW_OF_SLOT]), num_tokens * kmax)
    rows = carray(u8_ptr(rows_addr), (n, rb))
    bad = combine_send_single(bases, lay, me, epoch, rows, ints[0], ints[1], ints[2], elem,
                              cs, k[K_BSP] != 0)
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
def combine_poll_at(state, epoch, idx_addr, w_addr, num_tokens, top_k, weighted, rb, es, ecode,
                    lut_addr, n_lut, y_addr, hidden, spins, elem, cast, out_addr, rows_addr):
    """`combine_poll_single` over the routing at `idx_addr`/`w_addr` into the sums at
    `y_addr`, or (`cast` == CAST_16) rounded token by token into the 16-bit (bf16, or fp16
    where `ecode` is `ELEM_F16`) `[num_tokens, hidden]` at `out_addr` (then `y_addr` is not
    written); `lut_addr` is the
    `[n_lut]` float32 table of `ecode`. Once complete, `check_meta` of the hellos into
    `res[RES_META]` and the routed slots into `res[RES_ROUTED]`.

    Returns what is still missing (0: done).
    """
    k, lay, _ = consts(state)
    _, _, _, got, _, batch, hello, res = state_views(state, lay[L_WORLD], lay[L_EL])
    done = carray(u8_ptr(k[K_DONE_TOKENS]), num_tokens)
    row_of_slot = carray(i64_ptr(k[K_ROW_OF_SLOT]), num_tokens * lay[L_KMAX])
    idx = carray(i64_ptr(idx_addr), (num_tokens, top_k))
    w = carray(f32_ptr(w_addr), (num_tokens, top_k))
    lut = carray(f32_ptr(lut_addr), n_lut)
    if cast == CAST_16:
        y = carray(f32_ptr(y_addr), (0, hidden))
        out16 = carray(u16_ptr(out_addr), (num_tokens, hidden))
    else:
        y = carray(f32_ptr(y_addr), (num_tokens, hidden))
        out16 = carray(u16_ptr(out_addr), (0, hidden))
    missing = combine_poll_single(k[K_BASE], lay, epoch, idx, w, weighted, rb, es, ecode, lut,
                                  hello, got, done, batch, y, out16, k[K_ME], row_of_slot,
                                  rows_addr, spins, k[K_BSP] != 0)
    if missing:
        return missing
    res[RES_META] = check_meta(hello, elem)
    routed = 0
    for t in range(num_tokens):
        for j in range(top_k):
            if idx[t, j] >= 0:
                routed += 1
    res[RES_ROUTED] = routed
    return 0
