"""Triton kernels of the emulated superpod: P ranks' buffers in one device address space.

Layout (all row-major, one tensor per kind, the leading index is the rank that owns it):

* `win` `[P_dst, P_src, R, H]`: dispatch windows. Source s puts its rows for rank d in
  `win[d, s]`, ordered by (expert, ascending token): the plan's `window_pos` plus the
  source's own counts of d's earlier experts. `win_w`, `win_ts` `[P, P, R]` carry each row's
  weight and `token * K + slot`; `row_flag` `[P, P, R]` int32 its arrival flag.
* `counts` `[P_dst, P_src, E/P]` int32, `count_flag` `[P_dst, P_src]` int32.
* `recv_x` `[P, NC, H]` and `recv_w`, `recv_rank`, `recv_ts` `[P, NC]`: each rank's received
  rows in the oracle's order (expert-major, then source rank, then token).
* `cwin` `[P_src, T * K, H]`, `cflag` `[P_src, T * K]`: combine windows, one row per
  (token, slot) of the source.

Rows are moved as integer words of the row's width, so a moved row is bit-exact whatever
its dtype. Flags carry the call's epoch (token-flag fusion's "epoch in the flag"; the epoch
is kept on the device, see `_advance_epoch`): a writer stores its rows, synchronizes its
program (`debug_barrier`) and sets the row's flag with a release exchange; a reader polls
the flags with acquire loads (`atomic_add(ptr, 0)`). Every poll gives up after `max_spins`
rounds and records what it was waiting for in `err` `[programs, 4]` (phase, rank, peer,
flags missing), so a missing producer is an error, not a hang. A poll round is one L2
atomic per flag (about a microsecond on a GPU), which is the back-off: Triton has no
portable sleep.

Data written by another program of the same kernel (window rows and their metadata, the
counts) is read with `.cg` loads, which bypass the SM's L1: L1 is not coherent, and a line
holding a neighbour's row could have been cached before this row's flag went up.

Every wait is on a role with a lower id: the single-kernel modes put the producers of a
phase at the lowest ids and hand role ids out in arrival order (`_take_role`), so a
program only waits on programs that have started. The executor also checks that the whole
grid is resident at once (the persistent-kernel model: every role running side by side).
Triton's interpreter runs programs one after another in id order, so there the producers
have finished before a consumer polls.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)   # triton >= 3.4; before, the variable itself
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


#: kernels built for Triton's interpreter (TRITON_INTERPRET=1 when this module was imported)
INTERPRETED = _interpreting()
#: `err[:, 0]` codes: the phase a program was polling when it gave up
ERR_COUNTS, ERR_ROWS, ERR_COMBINE = 1, 2, 3


@triton.jit
def _poll(ptrs, mask, epoch, max_spins):
    """Poll `ptrs` (acquire) until every flag under `mask` holds `epoch`; return the misses."""
    f = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu")
    miss = mask & (f != epoch)
    missing = tl.sum(miss.to(tl.int32))
    spins = 0
    while (missing > 0) & (spins < max_spins):
        f = tl.atomic_add(ptrs, 0, mask=mask, sem="acquire", scope="gpu")
        miss = mask & (f != epoch)
        missing = tl.sum(miss.to(tl.int32))
        spins += 1
    return miss


@triton.jit
def _record(err, pid, code, rank, miss, peer, budget):
    """Note a give-up of program `pid` (phase code, rank, first missing peer, flags missing)
    if it is the program's first, and return the poll budget left: none after a give-up, so
    a program that gave up finishes at once instead of waiting at every later row."""
    missing = tl.sum(miss.to(tl.int32))
    if (missing > 0) & (budget > 0):
        first = tl.min(tl.where(miss, peer, 2147483647))
        tl.store(err + pid * 4, code)
        tl.store(err + pid * 4 + 1, rank)
        tl.store(err + pid * 4 + 2, first)
        tl.store(err + pid * 4 + 3, missing)
    return tl.where(missing > 0, 0, budget)


@triton.jit
def _copy_rows(dst, dst_row, src, src_row, mask, H, BH: tl.constexpr):
    """Copy rows `src_row[i]` -> `dst_row[i]` (int64 row indices, `[ROWS]`) of width H."""
    h = tl.arange(0, BH)
    for h0 in range(0, H, BH):
        hm = mask[:, None] & ((h0 + h) < H)[None, :]
        v = tl.load(src + src_row[:, None] * H + (h0 + h)[None, :], mask=hm, cache_modifier=".cg")
        tl.store(dst + dst_row[:, None] * H + (h0 + h)[None, :], v, mask=hm)


@triton.jit
def _send_counts(s, dlo, dhi, cnt, counts, count_flag, P, E, EL, epoch,
                 BP: tl.constexpr, BE: tl.constexpr, FLAG: tl.constexpr):
    """Rank s writes its per-expert counts into ranks [dlo, dhi)'s `counts[d, s]`."""
    d = tl.arange(0, BP)
    e = tl.arange(0, BE)
    dm = (d >= dlo) & (d < dhi)
    m = dm[:, None] & (e < EL)[None, :]
    c = tl.load(cnt + s * E + d[:, None] * EL + e[None, :], mask=m, other=0)
    tl.store(counts + (d[:, None] * P + s) * EL + e[None, :], c, mask=m)
    if FLAG:
        tl.debug_barrier()
        tl.atomic_xchg(count_flag + d * P + s, tl.zeros_like(d) + epoch, mask=dm,
                       sem="release", scope="gpu")


@triton.jit
def _send_rows(s, lo, hi, send_tok, send_slot, send_dst, send_pos, x, w, win, win_w, win_ts,
               row_flag, T, K, P, R, H, epoch,
               ROWS: tl.constexpr, BH: tl.constexpr, FLAG: tl.constexpr):
    """Rank s sends its plan's sends [lo, hi): row, weight and (token, slot), then the flag."""
    for i0 in range(lo, hi, ROWS):
        i = i0 + tl.arange(0, ROWS)
        m = i < hi
        t = tl.load(send_tok + i, mask=m, other=0)
        k = tl.load(send_slot + i, mask=m, other=0)
        d = tl.load(send_dst + i, mask=m, other=0)
        pos = tl.load(send_pos + i, mask=m, other=0)
        slot = (d * P + s) * R + pos
        _copy_rows(win, slot.to(tl.int64), x, (s * T + t).to(tl.int64), m, H, BH)
        tl.store(win_w + slot, tl.load(w + (s * T + t) * K + k, mask=m), mask=m)
        tl.store(win_ts + slot, t * K + k, mask=m)
        if FLAG:
            tl.debug_barrier()
            tl.atomic_xchg(row_flag + slot, tl.zeros_like(slot) + epoch, mask=m,
                           sem="release", scope="gpu")


@triton.jit
def _offsets(counts, d, P, EL, BP: tl.constexpr, BE: tl.constexpr):
    """Rank d's receive layout from `counts[d]`, flattened expert-major over `[BE, BP]`.

    Returns `(off, wbase, per_expert, total)`: `off[e*BP + s]` where (expert e, source s)'s
    rows start in `recv_x[d]`, `wbase[e*BP + s]` where they start in the window `win[d, s]`,
    `per_expert` `[BE]` rows per local expert, `total` the rows rank d receives.
    """
    e = tl.arange(0, BE)
    s = tl.arange(0, BP)
    m = (e < EL)[:, None] & (s < P)[None, :]
    c = tl.load(counts + (d * P + s[None, :]) * EL + e[:, None], mask=m, other=0,
                cache_modifier=".cg")
    per_expert = tl.sum(c, axis=1)
    expert_start = tl.cumsum(per_expert, axis=0) - per_expert
    off = expert_start[:, None] + tl.cumsum(c, axis=1) - c
    wbase = tl.cumsum(c, axis=0) - c
    return (tl.reshape(off, (BE * BP,)), tl.reshape(wbase, (BE * BP,)), per_expert,
            tl.sum(per_expert, axis=0))


@triton.jit
def _place_rows(pid, d, lo, hi, off, wbase, win, win_w, win_ts, row_flag, recv_x, recv_w,
                recv_rank, recv_ts, P, R, NC, H, epoch, max_spins, err,
                BP: tl.constexpr, BE: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr,
                POLL: tl.constexpr):
    """Rank d fills `recv_x[d, lo:hi]` from its windows (polling each row's flag if POLL)."""
    f = tl.arange(0, BE * BP)
    budget = tl.full([], max_spins, tl.int32)   # a tensor: it is reassigned in the loop
    for n0 in range(lo, hi, ROWS):
        n = n0 + tl.arange(0, ROWS)
        m = n < hi
        # the (expert, source) entry holding row n: the last whose start is <= n
        idx = tl.sum((off[None, :] <= n[:, None]).to(tl.int32), axis=1) - 1
        sel = f[None, :] == idx[:, None]
        start = tl.sum(tl.where(sel, off[None, :], 0), axis=1)
        base = tl.sum(tl.where(sel, wbase[None, :], 0), axis=1)
        s = idx % BP
        slot = (d * P + s) * R + base + (n - start)
        if POLL:
            miss = _poll(row_flag + slot, m, epoch, budget)
            budget = _record(err, pid, 2, d, miss, s, budget)
        dst = (d * NC + n).to(tl.int64)
        _copy_rows(recv_x, dst, win, slot.to(tl.int64), m, H, BH)
        tl.store(recv_w + dst, tl.load(win_w + slot, mask=m, cache_modifier=".cg"), mask=m)
        tl.store(recv_ts + dst, tl.load(win_ts + slot, mask=m, cache_modifier=".cg"), mask=m)
        tl.store(recv_rank + dst, s, mask=m)


@triton.jit
def _received(tokens_per_expert, d, EL, BE: tl.constexpr):
    """Rows rank d received in the latest dispatch (the sum of its `tokens_per_expert`)."""
    e = tl.arange(0, BE)
    return tl.sum(tl.load(tokens_per_expert + d * EL + e, mask=e < EL, other=0), axis=0)


@triton.jit
def _send_back(d, lo, hi, expert_out, out_stride, recv_rank, recv_ts, cwin, cflag, NC, TK, H,
               epoch, ROWS: tl.constexpr, BH: tl.constexpr, FLAG: tl.constexpr):
    """Rank d returns expert outputs `[lo, hi)` to their sources' combine windows."""
    for n0 in range(lo, hi, ROWS):
        n = n0 + tl.arange(0, ROWS)
        m = n < hi
        s = tl.load(recv_rank + d * NC + n, mask=m, other=0)
        ts = tl.load(recv_ts + d * NC + n, mask=m, other=0)
        slot = s * TK + ts
        src = d.to(tl.int64) * out_stride + n
        _copy_rows(cwin, slot.to(tl.int64), expert_out, src, m, H, BH)
        if FLAG:
            tl.debug_barrier()
            tl.atomic_xchg(cflag + slot, tl.zeros_like(slot) + epoch, mask=m,
                           sem="release", scope="gpu")


@triton.jit
def _reduce(pid, s, lo, hi, topk_idx, w, cwin, cflag, y, T, K, EL, H, epoch, max_spins, err,
            ROWS: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, POLL: tl.constexpr,
            WEIGHTED: tl.constexpr):
    """Rank s sums tokens `[lo, hi)`: fp32 sum over routed slots, in slot order, of w * row."""
    k = tl.arange(0, BK)
    h = tl.arange(0, BH)
    budget = tl.full([], max_spins, tl.int32)   # a tensor: it is reassigned in the loop
    for t0 in range(lo, hi, ROWS):
        t = t0 + tl.arange(0, ROWS)
        m = t < hi
        tk = (s * T + t)[:, None] * K + k[None, :]
        routed = m[:, None] & (k < K)[None, :]
        expert = tl.load(topk_idx + tk, mask=routed, other=-1)
        routed = routed & (expert >= 0)
        if POLL:
            miss = _poll(cflag + tk, routed, epoch, budget)
            budget = _record(err, pid, 3, s, miss, expert // EL, budget)
        for h0 in range(0, H, BH):
            hm = (h0 + h) < H
            acc = tl.zeros((ROWS, BH), dtype=tl.float32)
            for j in range(0, K):
                rj = s * T * K + t * K + j
                mj = m & (tl.load(topk_idx + rj, mask=m, other=-1) >= 0)
                mm = mj[:, None] & hm[None, :]
                v = tl.load(cwin + rj.to(tl.int64)[:, None] * H + (h0 + h)[None, :], mask=mm,
                            other=0.0, cache_modifier=".cg").to(tl.float32)
                if WEIGHTED:
                    v = tl.load(w + rj, mask=mj, other=0.0)[:, None] * v
                acc = tl.where(mm, acc + v, acc)
            row = (s * T + t).to(tl.int64)
            tl.store(y + row[:, None] * H + (h0 + h)[None, :], acc.to(y.dtype.element_ty),
                     mask=m[:, None] & hm[None, :])


@triton.jit
def _take_role(state):
    """This program's role id: its arrival order in the call (a ticket from `state[2]`).

    Roles are given in arrival order, not by program id, so a program only ever waits on
    roles with lower ids, which started before it: the single kernel cannot deadlock even
    if the device holds fewer programs at once than the grid (the hardware does not promise
    to start blocks in id order). Under the interpreter the ticket equals the program id.
    """
    return tl.atomic_add(state + 2, 1, sem="relaxed", scope="gpu")


@triton.jit
def _advance_epoch(state, epoch):
    """`state` = [epoch, programs done, tickets]: the last program of a call moves the epoch
    on and resets the counters for the next call.

    Every program read the epoch before it counted itself done, so the last one to count
    knows no program of this call still needs it. The epoch lives on the device so a call
    can be replayed from a CUDA graph; it never returns to 0, the flags' initial value.
    """
    tl.debug_barrier()
    done = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        tl.store(state + 1, 0)
        tl.store(state + 2, 0)
        tl.store(state, tl.where(epoch >= 2147483646, 1, epoch + 1))


# -- mode "ubep": one kernel per call, roles by program id -----------------------------------
@triton.jit
def ubep_dispatch(cnt, count_dest, send_lo, send_tok, send_slot, send_dst, send_pos, x, w,
                  counts, count_flag, win, win_w, win_ts, row_flag, recv_x, recv_w, recv_rank,
                  recv_ts, tokens_per_expert, err, state, P, E, EL, T, K, R, NC, H, C, S, RV,
                  max_spins, BP: tl.constexpr, BE: tl.constexpr, ROWS: tl.constexpr,
                  BH: tl.constexpr):
    """Dispatch in one kernel: P*C count programs, then P*S senders, then P*RV receivers.

    A count program sends its rank's counts to its plan's destination range; a sender copies
    its plan's rows into the destinations' windows; a receiver waits for every source's
    counts, computes where its share of the rows goes and moves each row once its flag is up.
    """
    pid = _take_role(state)
    epoch = tl.load(state)
    if pid < P * C:
        s = pid // C
        c = pid % C
        _send_counts(s, tl.load(count_dest + c), tl.load(count_dest + c + 1), cnt, counts,
                     count_flag, P, E, EL, epoch, BP, BE, True)
    elif pid < P * (C + S):
        g = pid - P * C
        _send_rows(g // S, tl.load(send_lo + g), tl.load(send_lo + g + 1), send_tok, send_slot,
                   send_dst, send_pos, x, w, win, win_w, win_ts, row_flag, T, K, P, R, H, epoch,
                   ROWS, BH, True)
    else:
        g = pid - P * (C + S)
        d = g // RV
        r = g % RV
        src = tl.arange(0, BP)
        miss = _poll(count_flag + d * P + src, src < P, epoch, max_spins)
        budget = _record(err, pid, 1, d, miss, src, max_spins)
        off, wbase, per_expert, total = _offsets(counts, d, P, EL, BP, BE)
        if r == 0:
            e = tl.arange(0, BE)
            tl.store(tokens_per_expert + d * EL + e, per_expert, mask=e < EL)
        _place_rows(pid, d, r * total // RV, (r + 1) * total // RV, off, wbase, win, win_w,
                    win_ts, row_flag, recv_x, recv_w, recv_rank, recv_ts, P, R, NC, H, epoch,
                    budget, err, BP, BE, ROWS, BH, True)
    _advance_epoch(state, epoch)


@triton.jit
def ubep_combine(topk_idx, w, expert_out, out_stride, tokens_per_expert, recv_rank, recv_ts, cwin,
                 cflag, y, err, state, P, EL, T, K, NC, H, S, RV, max_spins, BE: tl.constexpr,
                 ROWS: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr,
                 WEIGHTED: tl.constexpr):
    """Combine in one kernel: P*S programs send rows back, then P*RV programs reduce."""
    pid = _take_role(state)
    epoch = tl.load(state)
    if pid < P * S:
        d = pid // S
        j = pid % S
        n = _received(tokens_per_expert, d, EL, BE)
        _send_back(d, j * n // S, (j + 1) * n // S, expert_out, out_stride, recv_rank, recv_ts,
                   cwin, cflag, NC, T * K, H, epoch, ROWS, BH, True)
    else:
        g = pid - P * S
        s = g // RV
        r = g % RV
        _reduce(pid, s, r * T // RV, (r + 1) * T // RV, topk_idx, w, cwin, cflag, y, T, K, EL, H,
                epoch, max_spins, err, ROWS, BK, BH, True, WEIGHTED)
    _advance_epoch(state, epoch)


# -- mode "bsp": one kernel per phase, the kernel boundary as the barrier --------------------
@triton.jit
def bsp_counts(cnt, counts, P, E, EL, BP: tl.constexpr, BE: tl.constexpr):
    """Phase 1: every rank writes its counts to every rank."""
    _send_counts(tl.program_id(0), 0, P, cnt, counts, counts, P, E, EL, 0, BP, BE, False)


@triton.jit
def bsp_send(send_lo, send_tok, send_slot, send_dst, send_pos, x, w, win, win_w, win_ts,
             T, K, P, R, H, S, ROWS: tl.constexpr, BH: tl.constexpr):
    """Phase 2: P*S senders copy their plan's rows into the windows."""
    g = tl.program_id(0)
    _send_rows(g // S, tl.load(send_lo + g), tl.load(send_lo + g + 1), send_tok, send_slot,
               send_dst, send_pos, x, w, win, win_w, win_ts, win_ts, T, K, P, R, H, 0,
               ROWS, BH, False)


@triton.jit
def bsp_offsets(counts, offsets, wbases, tokens_per_expert, P, EL,
                BP: tl.constexpr, BE: tl.constexpr):
    """Phase 3: each rank turns the counts it received into its receive layout."""
    d = tl.program_id(0)
    off, wbase, per_expert, _ = _offsets(counts, d, P, EL, BP, BE)
    f = tl.arange(0, BE * BP)
    tl.store(offsets + d * (BE * BP) + f, off)
    tl.store(wbases + d * (BE * BP) + f, wbase)
    e = tl.arange(0, BE)
    tl.store(tokens_per_expert + d * EL + e, per_expert, mask=e < EL)


@triton.jit
def bsp_reorder(offsets, wbases, tokens_per_expert, win, win_w, win_ts, recv_x, recv_w, recv_rank,
                recv_ts, P, EL, R, NC, H, RV, BP: tl.constexpr, BE: tl.constexpr,
                ROWS: tl.constexpr, BH: tl.constexpr):
    """Phase 4: P*RV programs move the window rows to their places in `recv_x`."""
    g = tl.program_id(0)
    d = g // RV
    r = g % RV
    f = tl.arange(0, BE * BP)
    off = tl.load(offsets + d * (BE * BP) + f)
    wbase = tl.load(wbases + d * (BE * BP) + f)
    total = _received(tokens_per_expert, d, EL, BE)
    _place_rows(g, d, r * total // RV, (r + 1) * total // RV, off, wbase, win, win_w, win_ts,
                win_ts, recv_x, recv_w, recv_rank, recv_ts, P, R, NC, H, 0, 0, win_ts,
                BP, BE, ROWS, BH, False)


@triton.jit
def bsp_send_back(expert_out, out_stride, tokens_per_expert, recv_rank, recv_ts, cwin, EL, T, K,
                  NC, H, S, BE: tl.constexpr, ROWS: tl.constexpr, BH: tl.constexpr):
    """Combine phase 1: P*S programs copy expert outputs into their sources' windows."""
    g = tl.program_id(0)
    d = g // S
    j = g % S
    n = _received(tokens_per_expert, d, EL, BE)
    _send_back(d, j * n // S, (j + 1) * n // S, expert_out, out_stride, recv_rank, recv_ts,
               cwin, cwin, NC, T * K, H, 0, ROWS, BH, False)


@triton.jit
def bsp_reduce(topk_idx, w, cwin, y, T, K, EL, H, RV, ROWS: tl.constexpr, BK: tl.constexpr,
               BH: tl.constexpr, WEIGHTED: tl.constexpr):
    """Combine phase 2: P*RV programs sum each token's returned rows."""
    g = tl.program_id(0)
    s = g // RV
    r = g % RV
    _reduce(g, s, r * T // RV, (r + 1) * T // RV, topk_idx, w, cwin, cwin, y, T, K, EL, H, 0, 0,
            cwin, ROWS, BK, BH, False, WEIGHTED)


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (Triton tiles have power-of-two sides)."""
    return triton.next_power_of_2(max(int(n), 1))
