"""Compile (or load from Numba's cache) every kernel a call uses, before the first call.

Called at Buffer creation, before the bootstrap barrier, so that JIT time never counts
against a call's deadline while a peer waits.
"""

from __future__ import annotations

import numpy as np

from ubep.native.layout import CAST_16
from ubep.plan.fastplan import (
    BALANCED,
    HIERARCHICAL,
    STATIC,
    count_expert_range,
    count_experts,
    worker_sends,
)
from ubep.runtime.shm.direct.kernels import (
    combine_begin,
    copy_rows_for_peers,
    dispatch_begin,
    dispatch_rows,
    dispatch_rows_at,
    dispatch_rows_own,
    done_reading,
    gather_counts,
    place_rows,
    publish_counts,
    publish_ready,
    recv_meta,
    reduce_direct,
    reduce_direct_at,
    rows_for,
    send_rows_direct,
)
from ubep.runtime.shm.direct.kernels import combine_begin_at as direct_combine_begin_at
from ubep.runtime.shm.direct.kernels import dispatch_begin_at as direct_dispatch_begin_at
from ubep.runtime.shm.kernels.combine import (
    ELEM_F32,
    reduce_tokens_into,
    send_back,
    send_back_list,
)
from ubep.runtime.shm.kernels.dispatch import offsets, offsets_range, recv_rows, send_rows
from ubep.runtime.shm.kernels.local import (
    barrier_arrive,
    poll_at_least,
    poll_words_at_least,
    publish,
)
from ubep.runtime.shm.kernels.sentinel import sp_check_routing
from ubep.runtime.shm.kernels.slots import (
    check_meta,
    poll_counts,
    poll_hello,
    send_counts,
    send_hello,
    send_hellos,
    write_batch_flags,
)
from ubep.runtime.shm.region import (
    D_DONE_OFF,
    D_END,
    D_RECV_OFF,
    L_DROWS,
    L_EL,
    L_KMAX,
    L_SIZE,
    direct_layout,
)
from ubep.runtime.shm.staged.kernels import (
    RES_RECV,
    combine_begin_at,
    combine_poll_at,
    combine_poll_single,
    combine_send_single,
    dispatch_begin_at,
    dispatch_counts_at,
    dispatch_send_single,
    recv_rows_at,
    state_array,
    state_views,
)


def _warm_up_at(bases, lay, bsp: bool) -> None:
    """Compile (or load) the by-address kernels with the argument types of a real call."""
    base = int(bases[0])
    el = int(lay[L_EL])
    x = np.zeros((1, 8), np.uint8)
    idx = np.zeros((1, 1), np.int64)
    w = np.ones((1, 1), np.float32)
    order = np.arange(el, dtype=np.int64)
    hop = np.zeros(1, np.int64)
    done_rows = np.zeros(max(int(lay[L_DROWS]), 1), np.uint8)
    done_tokens = np.zeros(1, np.uint8)
    mine = np.zeros(max(int(lay[L_DROWS]), 1), np.int64)
    row_of_slot = np.zeros(max(int(lay[L_KMAX]), 1), np.int64)
    state = state_array(1, el, base=base, bases=bases, lay=lay, me=0, bsp=bsp,
                        done_rows=done_rows, done_tokens=done_tokens, mine=mine,
                        row_of_slot=row_of_slot, rank_of_expert=order, hop_of_rank=hop,
                        kind=HIERARCHICAL, num_hop_classes=1)
    st = state.ctypes.data
    res = state_views(st, 1, el)[-1]
    tpe = np.zeros(el, np.int64)
    epoch = 5 if bsp else 4
    x_addr, idx_addr, w_addr = x.ctypes.data, idx.ctypes.data, w.ctypes.data
    dispatch_begin_at(st, epoch, x_addr, 1, 8, idx_addr, 1, w_addr, 0, tpe, 1)
    dispatch_counts_at(st, epoch, tpe, 0, 1)
    n = int(res[RES_RECV])
    ints, wts = np.zeros((3, n), np.int64), np.zeros(n, np.float32)
    out = np.zeros((max(n, 1), 8), np.uint8)
    recv_rows_at(st, epoch, n, out.ctypes.data, 8, wts, ints, x_addr, 1, w_addr, 1, 1)
    y = np.zeros((1, 2), np.float32)
    y16 = np.zeros((1, 2), np.uint16)
    lut = np.zeros(1, np.float32)
    combine_begin_at(st, epoch, out.ctypes.data, n, 8, ints, 0, 1)
    combine_poll_at(st, epoch, idx_addr, w_addr, 1, 1, True, 8, 4, ELEM_F32, lut.ctypes.data, 1,
                    y.ctypes.data, 2, 1, 0, CAST_16, y16.ctypes.data, out.ctypes.data)


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
        dispatch_send_single(bases, lay, 0, epoch, x, idx, w, order, np.zeros(1, np.int64),
                             HIERARCHICAL, 1, 0, cs, bsp, np.zeros(1, np.int64))
        got[:] = 0
        poll_counts(base, lay, epoch, 0, 1, rc, meta, got, 1)
        check_meta(meta, 0)
        n = offsets(rc, out_start, tpe)
        ints = np.zeros((3, n), np.int64)
        recv_rows(base, lay, epoch, rc, meta, out_start, 0, n, np.zeros(n, np.uint8),
                  np.zeros(1, np.int64), np.zeros((n, 8), np.uint8), np.zeros(n, np.float32),
                  ints[0], ints[1], ints[2], 1)
        combine_send_single(bases, lay, 0, epoch, np.zeros((n, 8), np.uint8), ints[0], ints[1],
                            ints[2], 0, cs, bsp)
        hello = np.full((1, 3), -1, np.int64)
        got[:] = 0
        combine_poll_single(base, lay, epoch, idx, w, True, 8, 4, ELEM_F32,
                            np.zeros(1, np.float32), hello, got, np.zeros(1, np.uint8),
                            np.zeros(1, np.int64), np.zeros((1, 2), np.float32),
                            np.zeros((0, 2), np.uint16), -1, np.zeros(1, np.int64), 0, 1, bsp)
        _warm_up_at(bases, lay, bsp)
    if multi:
        counts = np.zeros(lay[L_EL], np.int64)
        count_experts(idx, counts)
        count_expert_range(idx, 0, lay[L_EL], counts)
        send_counts(bases, lay, 0, 3, counts, 1, 0, 0, 0, 1)
        sp_check_routing(x, idx, w, 64)
        hop = np.zeros(1, np.int64)
        for kind in (STATIC, BALANCED, HIERARCHICAL):
            _, sends, pos = worker_sends(idx, lay[L_EL], lay[L_EL], hop, order, kind, 2, 1, 0)
        send_rows(bases, lay, 0, 3, x, idx, w, sends, pos, counts, cs)
        offsets_range(rc, 0, lay[L_EL], out_start, tpe)
        write_batch_flags(bases, lay, 0, 0, 3, 0, cs)
        poll_hello(base, lay, 3, meta, got, 1)
        send_hello(bases, lay, 0, 3, 1, 0, 0)
        send_hellos(bases, lay, 0, 3, 1, 0, 0, 0, 1)
        send_back(bases, lay, 3, x, ints[0], ints[1], ints[2], 0, 0, cs)
        labels = ints[0].reshape(-1, 1)
        _, rows, _ = worker_sends(labels, 1, 1, hop, np.zeros(1, np.int64), HIERARCHICAL, 2, 1,
                                  0)
        send_back_list(bases, lay, 3, x, ints[0], ints[1], ints[2], rows[:, 0].copy(), cs)
        reduce_tokens_into(base, lay, 3, idx, w, True, 8, 4, ELEM_F32, np.zeros(1, np.float32),
                           meta, 0, 0, np.zeros(1, np.uint8), np.zeros(1, np.int64),
                           np.zeros((1, 2), np.float32), np.zeros((0, 0), np.uint16), 1)
        counter = np.zeros(1, np.int64)
        barrier_arrive(counter.ctypes.data)
        poll_at_least(counter.ctypes.data, 1, 1)
        publish(counter.ctypes.data, 0)
    del mem


def warm_up_direct() -> None:
    """Compile (or load from cache) the direct kernels on a private 1-rank region, before the
    bootstrap barrier, so JIT time never counts against a call's deadline."""
    dlay = direct_layout(start=0, world=1, num_experts=2, hidden=2, max_tokens=1, max_top_k=1)
    mem = np.zeros(int(dlay[D_END]) + 64, np.uint8)
    base = (mem.ctypes.data + 63) // 64 * 64
    bases = np.array([base], np.int64)
    idx = np.zeros((1, 1), np.int64)
    w = np.ones((1, 1), np.float32)
    x = np.zeros((1, 8), np.uint8)
    counts = np.zeros((1, 2), np.int64)
    got = np.zeros(1, np.int8)
    tails = np.zeros((1, 4), np.int64)
    roff = int(dlay[D_RECV_OFF])
    pos = np.empty((1, 1), np.int64)
    tpe = np.empty(2, np.int64)
    ints = np.zeros((3, 1), np.int64)
    wts = np.zeros(1, np.float32)
    y = np.zeros((1, 2), np.float32)
    ready = np.full(1, -1, np.int64)
    done = np.zeros(1, np.uint8)
    for epoch in (1, 2):     # the one-worker entries, then the pieces the pool path calls
        dispatch_begin(bases, dlay, 0, epoch, idx, 2, 0, roff, counts, tails, got, 1)
        dispatch_rows(bases, dlay, 0, epoch, 0, tails, counts, 2, idx, w, pos, tpe, ints, wts,
                      x.ctypes.data, 8, 0 if epoch == 1 else y.ctypes.data, 1)
        done[:] = 0
        combine_begin(bases, dlay, 0, epoch, 2, int(dlay[D_RECV_OFF]), x.ctypes.data,
                      epoch - 1, ints[0], idx, w, True, pos, 2, 8, 4, ELEM_F32,
                      np.zeros(1, np.float32), ready, done, y, np.zeros((epoch - 1, 2), np.uint16),
                      1)
    y16 = np.zeros((1, 2), np.uint16)
    for epoch in (3, 4):     # the one-worker entries by address, fp32 then bf16 sums
        out_addr = y16.ctypes.data if epoch == 4 else 0
        direct_dispatch_begin_at(bases, dlay, 0, epoch, idx.ctypes.data, 1, 1, 2, 0, roff,
                                 counts, tails, got, 1)
        dispatch_rows_at(bases, dlay, 0, epoch, 0, tails, counts, 2, idx.ctypes.data,
                         w.ctypes.data, 1, 1, pos.ctypes.data, tpe, ints, wts, x.ctypes.data, 8,
                         0 if epoch == 3 else y.ctypes.data, 1)
        dispatch_rows_own(bases, dlay, 0, epoch, 0, tails, counts, 2, idx.ctypes.data,
                          w.ctypes.data, 1, 1, pos.reshape(-1), tpe, ints, wts, x.ctypes.data, 8,
                          0 if epoch == 3 else y.ctypes.data, 1)
        direct_combine_begin_at(bases, dlay, 0, epoch, 2, int(dlay[D_RECV_OFF]), x.ctypes.data,
                                0, ints[0], idx.ctypes.data, w.ctypes.data, 1, 1, True,
                                pos.ctypes.data, 2, 8, 4, ELEM_F32, np.zeros(1, np.float32),
                                ready, done, y.ctypes.data, out_addr, 2, 1,
                                np.array([base + int(dlay[D_DONE_OFF])], np.int64),
                                base + int(dlay[D_DONE_OFF]))
        reduce_direct_at(bases, dlay, epoch, idx.ctypes.data, w.ctypes.data, 1, 1, True,
                         pos.ctypes.data, 2, 8, 4, 2, ELEM_F32, np.zeros(1, np.float32), ready,
                         done, y.ctypes.data, out_addr, 2, 0, 0, 1)
        done_at = base + int(dlay[D_DONE_OFF])
        done_reading(np.array([done_at], np.int64), done_at, 1, epoch, 1)
    got[:] = 0
    publish_counts(base, dlay, 5, idx, 2, 0, roff)
    gather_counts(bases, dlay, 5, counts, tails, got, 1)
    n = place_rows(counts, 0, 2, idx, pos, tpe, ints[0])
    ints[1] = -1
    send_rows_direct(bases, dlay, 5, x.ctypes.data, 8, idx, w, pos, 2, 0, 1, 0, y.ctypes.data,
                     ints[1], ints[2], wts, tails)
    recv_meta(base, dlay, 5, 0, n, ints[1], ints[2], wts, y.ctypes.data, roff, 8, 1)
    rows_for(counts, 0)
    copy_rows_for_peers(base + int(dlay[D_RECV_OFF]), x.ctypes.data, 8, ints[0], 1, 1)
    publish_ready(base, dlay, 5, 2, int(dlay[D_RECV_OFF]))
    reduce_direct(bases, dlay, 5, idx, w, True, pos, 2, 8, 4, 2, ELEM_F32,
                  np.zeros(1, np.float32), 0, 1, np.full(1, -1, np.int64),
                  np.zeros(1, np.uint8), y, np.zeros((0, 2), np.uint16), 0, 0, 1)
    poll_words_at_least(base, 1, 0, 1)
    del mem


def warm_up_elastic(lay_of) -> None:
    """Compile (or load from cache) the elastic membership kernels (`members`) on a private
    1-rank region, as `warm_up` (`Buffer(elastic=True)`)."""
    from ubep.runtime.shm.kernels import members as KM

    lay = lay_of()
    mem = np.zeros(int(lay[L_SIZE]) + 64, np.uint8)
    base = (mem.ctypes.data + 63) // 64 * 64
    bases = np.array([base], np.int64)
    KM.or_into(bases, 0)
    KM.publish_drain(bases + 64, np.int64(1), 1)
    KM.poll_drain(base + 64, np.zeros(1, np.int64), 1, np.zeros(1, np.int64), 1)
    none = np.zeros(0, np.int64)
    KM.proxy_counts(bases, lay, 0, 1, none, np.zeros(int(lay[L_EL]), np.int64), 0)
    KM.proxy_hellos(bases, lay, 0, 1, none, 0)
    del mem
