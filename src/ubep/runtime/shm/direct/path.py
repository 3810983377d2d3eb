"""The direct (one-copy) variant of the shm runtime: `Buffer(backend="shm", direct=True)`.

The paper's mechanism copies each row twice: into a window at its destination, then into
place once the offsets are known. When counts are cheap to exchange (ranks of one host),
exchange them first and every row's final place is known to its sender:

dispatch: publish my per-expert counts -> read every rank's (the only wait before data)
    -> copy each row straight into its destination's expert-major output, then release its
    meta word {token, slot, weight, epoch} -> wait for my N rows' meta words.
combine:  publish where my expert outputs lie (in place if `expert_out` is `recv_x` or the
    tensor of `get_combine_buffer`, else after one local copy) -> sum each of my tokens by
    reading its rows where they lie, as soon as their ranks have published -> tell every rank
    I am done reading (a done word in each region) -> wait until every rank is done reading
    mine. So once combine returns, `recv_x` and the combine buffer are the caller's again
    (peers read them no more), and combining the latest dispatch again is a fresh round.

So dispatch copies each row once and combine reads it once. The price: `recv_x` is a view of
this Buffer's shared memory, valid until its next dispatch (as DeepEP's low-latency mode),
and each rank needs room for the rows it could receive.

`direct="owned"` keeps the one copy per row and gives the caller what any EP library gives:
results valid while held, any handle combinable. Each rank has `1 + OWNED_LENT_AREAS` recv
areas and names, in its count slot, the one this dispatch's rows go to: an area whose
previous `recv_x` the caller has let go of (no tensor, view or array on the area's torch
storage is left but this path's own: a use-count test, `_free_area`) is lent again as this
`recv_x`, so rows land in it once and nothing is copied out (the tensor is made while
they travel). If the caller still holds every lent area, the rows land in the scratch
area 0 and are copied out into a private tensor (from the output pool) as each row's meta
word arrives, inside the wait for the rows; a rank's rows for its own
experts then go from `x` straight into that tensor. Everything combine needs (each row's
place `pos`) lives in the handle, not in kept scratch, so any handle can be combined, in any
order, as often as wanted. Combine reads a lent `recv_x` (or any tensor in a lent area) in
place; other expert outputs are published by one local copy of the rows peers read into the
combine area, and a rank's own rows are summed where they lie. Reuse is safe: an area is
named only while nobody holds a tensor on it, and a rank publishes the counts of dispatch
e+1 only after its dispatch e returned (every row of e arrived, or was copied out), so nobody
overwrites rows still needed; combine areas are guarded by the done words as below.

Why reuse is safe with one buffer per area: a rank publishes its counts of call e+1 only after
its combine of call e returned, and nobody writes rows, metas or ready words of e+1 before it
has every rank's counts of e+1. Count slots alternate by epoch parity (a rank can be one
count ahead of a peer that still reads).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ubep.handle import (
    CombineResult,
    DispatchHandle,
    DispatchResult,
    new_combine_result,
    new_dispatch_result,
    new_handle,
    rerouted,
)
from ubep.native.layout import (
    DW_C_EPOCH,
    DW_EPOCH,
    DW_LAST_CALL,
    DW_LAST_CODE,
    DW_LEN,
    DW_LENT_COMB,
)
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.direct import kernels as DK
from ubep.runtime.shm.elements import cast_rows, combine_elem
from ubep.runtime.shm.kernels.local import poll_words_at_least
from ubep.runtime.shm.outputs import OutputPool
from ubep.runtime.shm.protocol import DTYPE_CODES, ShmProtocolError
from ubep.runtime.shm.region import (
    D_AREA,
    D_COMB_OFF,
    D_DONE_OFF,
    D_MAXR,
    D_META_OFF,
    D_NRECV,
    D_RECV_OFF,
)
from ubep.runtime.shm.waits import INLINE_SPINS, deadline_after, now_us
from ubep.stats import DeferredStats, Interval, Stats
from ubep.validate import MOVABLE_DTYPES, byte_span

_CODES = DTYPE_CODES
_DTYPES = {code: dtype for dtype, code in _CODES.items()}
NO_16 = np.zeros((0, 0), np.uint16)        # reduce_direct: "do not round here"
#: combine dtypes whose fp32 sums the kernels round into the output (the rest: fp32 sums in
#: place, fp8 cast after); the compiled entry takes these and fp32
ROUNDED = (torch.bfloat16, torch.float16)
#: `ubep.native.direct_combine`'s output kinds: fp32 sums in place, else rounded to these
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: strong references to a torch storage (by its `_cdata`): `_free_area`'s test, ~0.1 µs
_use_count = torch._C._storage_Use_Count


@functools.cache
def combine_codes(dtype: torch.dtype) -> tuple[int, int, np.ndarray]:
    """(dtype code, element code, fp32 lookup table) of combine rows of `dtype`."""
    return (_CODES[dtype], *combine_elem(dtype))


def _protocol_error(msg: str) -> Exception:
    return ShmProtocolError(msg)


class DirectPath:
    """Dispatch and combine of a rank with rows written straight to their place."""

    def __init__(self, ctx: ShmContext):
        self.ctx = backend = ctx
        dlay = ctx.dlay
        region = ctx.region
        self.dlay = dlay
        c = backend.config
        self.el = c.experts_per_rank
        self.num_experts = c.num_experts
        self.hidden = c.hidden
        self.max_recv = max(int(dlay[D_MAXR]), 1)
        w = backend.world
        self._counts = np.zeros((w, c.num_experts), np.int64)
        self._tails = np.zeros((w, 4), np.int64)     # count slots' DC_* words
        self._got = np.zeros(w, np.int8)
        area = int(dlay[D_AREA])
        self._meta = region[int(dlay[D_META_OFF]):][:16 * self.max_recv].view(np.int64)
        self._done_off = int(dlay[D_DONE_OFF])
        self._done = region[self._done_off:][:8 * w].view(np.int64)
        # `_done_reading`'s addresses: my word on every rank, and every rank's word on mine
        self._done_mine = ctx.bases + (self._done_off + 8 * ctx.rank)
        self._done_first = ctx.base + self._done_off
        self._recv_addr = backend.base + int(dlay[D_RECV_OFF])
        self._recv_off, self._area = int(dlay[D_RECV_OFF]), area
        # owned, per recv area: its torch storage (`_cdata`, 0 until first lent), the uint8
        # tensor on it and the references to it this path holds itself (`_free_area`)
        nrecv = int(dlay[D_NRECV])
        self._area_cdata: list[int] = [0] * nrecv
        self._area_u8: list[torch.Tensor | None] = [None] * nrecv
        self._area_uses: list[int] = [0] * nrecv
        self._area_views: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        # owned: byte range of the lent areas (a tensor there is combined in place)
        self._lent_lo = self._recv_addr + area
        self._lent_hi = self._recv_addr + area * int(dlay[D_NRECV])
        self._comb_addr = backend.base + int(dlay[D_COMB_OFF])
        self._areas = {"recv": torch.from_numpy(region[int(dlay[D_RECV_OFF]):][:area]),
                       "comb": torch.from_numpy(region[int(dlay[D_COMB_OFF]):][:area])}
        self._views: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._y = np.zeros((c.max_tokens_per_rank, c.hidden), np.float32)  # fp32 sums, kept
        self._y_addr = self._y.ctypes.data
        self._timeout_s = c.timeout_s
        #: direct="owned": recv_x copied out, `pos` in each handle, any handle combinable
        self.owned = c.direct == "owned"
        self._lend = OutputPool()       # owned recv_x and combine outputs: no page faults
        #: the state this path shares with its compiled door (`ubep.native.layout`'s DW_*
        #: words): the epochs, the latest dispatch and its rows' dtype, the dispatch whose
        #: combine buffer was lent (owned)
        self._w = np.zeros(DW_LEN, np.int64)
        self._w[DW_LAST_CODE] = _CODES[torch.bfloat16]
        # one worker, direct=True: kept scratch (only the latest dispatch can be combined)
        self._pos = np.zeros(c.max_tokens_per_rank * c.max_top_k, np.int64)
        self._pos_addr = self._pos.ctypes.data
        self._done_t = np.zeros(c.max_tokens_per_rank, np.uint8)
        self._ready = np.full(w, -1, np.int64)
        #: elastic: ranks whose rows the latest combine dropped (died before publishing), and
        #: those the latest pool dispatch dropped (died with rows of theirs still missing)
        self.dropped: list[int] = []
        #: the compiled entries (`ubep.native`; `DirectNativePath`), None here
        self._native = None

    def release_outputs(self) -> None:
        """Drop the output pool's kept blocks (`ShmBackend.close`)."""
        self._lend.close()


    # -- views of my areas -------------------------------------------------------------------
    def _view(self, area: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """`[n, hidden]` of `dtype` at the start of my area `area` ("recv" or "comb")."""
        v = self._views.get((area, dtype))
        if v is None:
            rows = self._areas[area].numel() // (self.hidden * dtype.itemsize)
            v = self._views[area, dtype] = self._areas[area][
                :rows * self.hidden * dtype.itemsize].view(dtype).view(rows, self.hidden)
        return v.as_strided((n, self.hidden), (self.hidden, 1))   # cheaper than v[:n] here

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """`[N, hidden]` of `dtype` (None: the dispatched rows' dtype) in my shared memory:
        expert outputs written here are read in place by combine. Valid until the next
        dispatch (direct=True) or the next combine or get_combine_buffer (direct="owned": one
        combine area serves every handle)."""
        dtype = dtype or _DTYPES[int(self._w[DW_LAST_CODE])]
        if handle.call != self._w[DW_LAST_CALL] and not self.owned:
            raise ValueError("get_combine_buffer: the handle is not from this Buffer's latest "
                             "dispatch; with direct=True only the latest one can be combined")
        if dtype not in MOVABLE_DTYPES or not dtype.is_floating_point:
            raise TypeError(f"dtype {dtype} cannot be combined; use a floating dtype of at "
                            f"most 4 bytes")
        if self.owned:
            self._w[DW_LENT_COMB] = handle.call
        return self._view("comb", handle.num_recv, dtype)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int, t0: float) -> DispatchResult:
        area = self._free_area() if self.owned else 0   # owned: a free lent area, else scratch
        roff = self._recv_off + area * self._area
        self._w[DW_EPOCH] = epoch = int(self._w[DW_EPOCH]) + 1
        return self._dispatch_from(x, topk_idx, topk_weights, call, t0, epoch, area, roff)

    def _dispatch_from(self, x, topk_idx, topk_weights, call, t0, epoch, area,
                       roff) -> DispatchResult:
        """`dispatch` once it has its epoch and where rows land (`area` at `roff`)."""
        return self._dispatch_py(x, topk_idx, topk_weights, call, t0, epoch, area, roff, None,
                                 False)

    def _in_place(self, area: int) -> bool:
        """Whether a dispatch's rows land where its `recv_x` lies (a lent area, or the recv
        area with direct=True), not copied out of the scratch area."""
        return bool(area) or not self.owned

    def _dispatch_py(self, x, topk_idx, topk_weights, call, t0, epoch, area, roff, keep,
                     begun) -> DispatchResult:
        """`dispatch` in Python: the whole call, or (`begun`) from where the compiled entry
        stopped once it published my counts but found some missing (`keep`: the `pos` it made
        for an owned handle)."""
        b = self.ctx
        code = _CODES[x.dtype]
        deadline = deadline_after(t0, self._timeout_s)
        counts, tails, got, dlay, bases = self._counts, self._tails, self._got, self.dlay, b.bases
        t_n, k_n = topk_idx.shape
        members = b.members
        if begun:                       # the compiled entry published my counts
            left = 1
        else:
            if self.owned:              # the handle's `pos`
                keep = np.empty(t_n * k_n, np.int64)
            spins = 1 if members is not None and members.members.any_inactive else INLINE_SPINS
            left, n_recv = DK.dispatch_begin_at(bases, dlay, b.rank, epoch, topk_idx.data_ptr(),
                                                t_n, k_n, self.num_experts, code, roff, counts,
                                                tails, got, spins)
        if left:
            b.wait(lambda s: DK.gather_counts(bases, dlay, epoch, counts, tails, got, s),
                    "dispatch/counts", lambda: [s for s in range(b.world) if not got[s]],
                    deadline=deadline,
                    on_inactive=lambda: self._skip_counts(epoch, code))
            n_recv = DK.rows_for(counts, b.rank)
            if members is not None and members.members.any_inactive:
                # ranks found inactive while their counts were awaited get no rows of mine
                # (the counts I published for their experts place nobody else's rows)
                topk_idx = members.members.mask(topk_idx)[0]
        t1 = now_us()
        tpe = np.empty(self.el, np.int64)
        ints = np.empty((3, n_recv), np.int64)   # src rank, token, slot: exactly N each
        wts = np.empty(n_recv, np.float32)
        rb = x.shape[1] * x.element_size()
        if self.owned and area and n_recv:      # rows land in recv_x itself, made below while
            recv_x, dst = None, 0               # they travel (off the path to sending mine)
        elif self.owned:                # rows copied out of the area as they arrive
            recv_x = self._lend.empty(n_recv, x.shape[1], x.dtype)
            dst = recv_x.data_ptr() if n_recv else 0
        else:
            recv_x, dst = self._view("recv", n_recv, x.dtype), 0
        return self._dispatch_rows(x, topk_idx, topk_weights, call, t0, t1, epoch, area, roff,
                                   keep, tpe, ints, wts, rb, code, deadline, recv_x, dst)

    def _dispatch_rows(self, x, topk_idx, topk_weights, call, t0, t1, epoch, area, roff, keep,
                       tpe, ints, wts, rb, code, deadline, recv_x, dst) -> DispatchResult:
        """My rows sent, then the rows I receive awaited (every rank's counts in)."""
        b = self.ctx
        counts, tails, dlay, bases = self._counts, self._tails, self.dlay, b.bases
        t_n, k_n = topk_idx.shape
        idx_addr, w_addr = topk_idx.data_ptr(), topk_weights.data_ptr()
        if self.owned:                  # `pos` goes with the handle: any handle combinable
            n_recv, missing, pos_addr = DK.dispatch_rows_own(
                bases, dlay, b.rank, epoch, code, tails, counts, self.el, idx_addr, w_addr,
                t_n, k_n, keep, tpe, ints, wts, x.data_ptr(), rb, dst, INLINE_SPINS)
            if recv_x is None and n_recv >= 0:
                recv_x = self._lend_area(area, roff, n_recv, x.shape[1], x.dtype)
        else:                           # kept scratch: only the latest dispatch combinable
            pos_addr = self._pos_addr
            n_recv, missing = DK.dispatch_rows_at(bases, dlay, b.rank, epoch, code, tails,
                                                  counts, self.el, idx_addr, w_addr, t_n,
                                                  k_n, pos_addr, tpe, ints, wts,
                                                  x.data_ptr(), rb, dst, INLINE_SPINS)
        state = (idx_addr, w_addr, k_n, epoch, pos_addr, keep, ints)
        return self._dispatch_end(x, topk_idx, topk_weights, call, epoch, deadline, (t0, t1),
                                  roff, n_recv, missing, tpe, ints, wts, state, recv_x, dst)

    def _dispatch_end(self, x, topk_idx, topk_weights, call, epoch, deadline, ts, roff, n_recv,
                      missing, tpe, ints, wts, state, recv_x, dst=0) -> DispatchResult:
        """One worker, every rank's counts in and my rows sent: wait for the `missing` rows
        I receive, then the result."""
        b = self.ctx
        if n_recv < 0:
            raise self._dtype_error(x.dtype, missing)
        dropped: list[int] = []
        if missing:
            rb = x.shape[1] * x.element_size()
            b.wait(lambda s: DK.recv_meta(b.base, self.dlay, epoch, 0, n_recv, ints[1], ints[2],
                                          wts, dst, roff, rb, s),
                   "dispatch/rows", lambda: self._missing_sources(epoch, ints[0], 0, n_recv),
                   deadline=deadline,
                   on_inactive=lambda: self._drop_rows(ints, n_recv, dropped))
        res = self._dispatch_result(x, topk_idx, topk_weights, call, epoch, ts, None, n_recv,
                                    tpe, ints, wts, state, recv_x)
        if dropped:
            res.__dict__["_dropped"] = dropped
        return res

    def _dispatch_result(self, x, topk_idx, topk_weights, call, epoch, ts, ivs, n_recv, tpe,
                         ints, wts, state, recv_x) -> DispatchResult:
        self._w[DW_LAST_CALL], self._w[DW_LAST_CODE] = call, _CODES[x.dtype]
        t2 = now_us()
        handle = new_handle(self.ctx.buffer_id, call, topk_idx.shape[0], n_recv, x.shape[1],
                            topk_idx, topk_weights, ints, state)
        stats = DeferredStats.of(self._dispatch_stats, (*ts, t2), ivs, topk_idx, n_recv,
                                 x.shape[1] * x.element_size(), epoch)
        return new_dispatch_result(recv_x, wts, tpe, handle, stats)

    def _free_area(self) -> int:
        """owned: a lent recv area nobody holds a tensor on any more, else 0 (scratch).

        Each lent area has one torch storage, made here; every tensor on it (a lent `recv_x`,
        a view or slice of it, a numpy array or autograd node holding one) holds a strong
        reference to that storage. So the area is free exactly when the storage's use count
        is the number of references this path keeps itself (its cached typed views)."""
        cdata, mine = self._area_cdata, self._area_uses
        for i in range(1, len(cdata)):
            if not cdata[i] or _use_count(cdata[i]) == mine[i]:
                return i
        return 0

    def _lend_area(self, area: int, roff: int, n: int, hidden: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """`[n, hidden]` of `dtype` on recv area `area` (at byte `roff` of my region), lent to
        the caller: a strided view of the area's kept typed tensor (see `_free_area`)."""
        return self._area_view(area, roff, hidden, dtype).as_strided((n, hidden), (hidden, 1))

    def _area_view(self, area: int, roff: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Recv area `area` (at byte `roff`) as `[rows, hidden]` of `dtype`, kept: a tensor
        lent from it holds the area's storage, which is what `_free_area` counts."""
        v = self._area_views.get((area, dtype))
        if v is None:                   # the whole area as rows of `dtype`, once
            es = dtype.itemsize
            n_max = self._area // (hidden * es)
            if not self._area_cdata[area]:
                u8 = torch.from_numpy(self.ctx.region[roff:roff + self._area])
                self._area_cdata[area] = u8.untyped_storage()._cdata
                self._area_u8[area] = u8
                self._area_uses[area] = _use_count(self._area_cdata[area])
            before = _use_count(self._area_cdata[area])
            v = self._area_u8[area][:n_max * hidden * es].view(dtype).view(n_max, hidden)
            self._area_views[area, dtype] = v
            self._area_uses[area] += _use_count(self._area_cdata[area]) - before
        return v

    def _dtype_error(self, dtype: torch.dtype, rank: int) -> Exception:
        return _protocol_error(
            f"rank {self.ctx.rank} dispatches {dtype} rows but rank {rank} uses "
            f"{MOVABLE_DTYPES[int(self._tails[rank, 0])]}; every rank must pass the same dtype")

    def _missing_sources(self, epoch: int, src_rank: np.ndarray, lo: int, hi: int) -> list[int]:
        """Ranks some of whose rows in [lo, hi) have not arrived (for the timeout message)."""
        ep = epoch & 0x7FFFFFFF
        return sorted({int(src_rank[i]) for i in range(lo, hi)
                       if int(self._meta[2 * i + 1]) >> 32 != ep})

    # -- elastic (`Buffer(elastic=True)`, `membership.py`): stop waiting for inactive ranks --
    def _skip_counts(self, epoch: int, code: int) -> None:
        """Dispatch's counts: an inactive rank whose counts of `epoch` did not come sends
        nothing (its count row zero, its dtype word mine); one whose counts came is kept
        (every survivor read the same ones: it published them before it died)."""
        b = self.ctx
        DK.gather_counts(b.bases, self.dlay, epoch, self._counts, self._tails, self._got, 1)
        for r in b.members.members.inactive:
            if not self._got[r]:
                self._got[r] = 1
                self._counts[r] = 0
                self._tails[r] = (code, 0, 0, 0)

    def _drop_rows(self, ints: np.ndarray, n_recv: int, dropped: list[int]) -> None:
        """Dispatch's rows: rows of an inactive rank are all kept if all arrived, else all
        dropped (marked decoded here so no wait is for them; the backend then leaves them
        out of the result). `dropped` collects such ranks."""
        src, tok = ints[0, :n_recv], ints[1, :n_recv]
        for r in self.ctx.members.members.inactive:
            if r in dropped:
                continue
            mine = src == r
            if mine.any() and (tok[mine] < 0).any():
                dropped.append(r)
                ints[1, :n_recv][mine] = 0
                ints[2, :n_recv][mine] = 0

    def _proxy_done(self) -> None:
        """Combine's done words: an inactive rank reads none of my expert outputs; its word
        on my region counts as done for every epoch (rewritten every combine: a removed rank
        that still calls must not lower it)."""
        for r in self.ctx.members.members.inactive:
            self._done[r] = 1 << 62

    def _drop_ready(self, handle: DispatchHandle, cur: list, dropped: list[int]) -> None:
        """Combine's rows: tokens stop waiting for inactive ranks that have not published
        their expert outputs (`cur[0]` becomes the routing without them; no token summed
        any of their rows, since none was readable); one that published is read in full."""
        self._proxy_done()
        m = self.ctx.members.members
        gone = [r for r in m.inactive if self._ready[r] < 0 and r not in dropped]
        if not gone:
            return
        idx, hit = m.mask(cur[1], gone)
        if hit is not None:
            dropped.extend(r for r in gone if r not in dropped)
            cur[0], cur[1] = idx.data_ptr(), idx

    def skip_epochs(self, n: int) -> None:
        """`set_active_ranks`: advance both epochs by `n` (even), so a removed rank that
        still calls never matches the remaining ranks' counts or outputs."""
        self._w[DW_EPOCH] += n
        self._w[DW_C_EPOCH] += n

    def with_routing(self, handle: DispatchHandle, idx: torch.Tensor) -> DispatchHandle:
        """A copy of `handle` whose combine uses routing `idx` (masked)."""
        st = handle.state
        if len(st) == 5:                # the pool's (idx, w, pos, epoch, src_rank)
            state = (idx.numpy(), *st[1:])
        else:                           # one worker's (idx_addr, w_addr, ...)
            state = (idx.data_ptr(), *st[1:])
        return rerouted(handle, idx, state)

    def _dispatch_stats(self, ts, ivs, topk_idx: torch.Tensor, n_recv: int, rb: int,
                        epoch: int) -> Stats:
        t0, t1, t2 = ts
        n_sent = int(np.count_nonzero(topk_idx.numpy() >= 0))
        r = self.ctx.rank
        intervals = self._intervals(Interval(r, 0, "counts", t0, t1, "wait"), "send_recv", t2,
                                    ivs)
        return Stats(op="dispatch", backend="shm", mode="ubep", sync="row-flag",
                     schedule="static", rank=r, total_us=t2 - t0,
                     phases_us={"counts": t1 - t0, "send_recv": t2 - t1}, intervals=intervals,
                     bytes_sent=n_sent * (rb + 16), bytes_recv=n_recv * (rb + 16),
                     payload_efficiency=rb / (rb + 16),
                     extra={"epoch": epoch, "workers": self.ctx.workers,
                            "direct": self.ctx.config.direct})

    def _intervals(self, first: Interval, rest: str, end: float, ivs) -> list[Interval]:
        """`first`, then the workers' intervals of the pool path (`ivs`), or one interval
        `rest` up to `end` on the one-worker path."""
        if ivs is None:
            return [first, Interval(first.rank, 0, rest, first.end_us, end)]
        return [first, *(Interval(first.rank, j, *iv) for j, ivj in enumerate(ivs)
                         for iv in ivj)]

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                t0: float, dest: torch.Tensor | None = None) -> CombineResult:
        b = self.ctx
        if dest is not None:
            lo, hi = byte_span(dest)
            if lo < self._comb_addr + self._area and self._comb_addr < hi:
                raise ValueError(
                    "out lies in this Buffer's combine buffer (get_combine_buffer's memory), "
                    "where combine puts the rows peers read while it sums: pass an out of "
                    "your own (or combine without out)")
        if handle.call != self._w[DW_LAST_CALL] and not self.owned:
            raise ValueError("handle is not from this Buffer's latest dispatch; with "
                             "direct=True only the latest dispatch can be combined (its rows "
                             "live in the Buffer until the next one); direct='owned' combines "
                             "any handle")
        dtype = expert_out.dtype
        code, ecode, lut = combine_codes(dtype)
        es = dtype.itemsize
        rb = self.hidden * es
        n_recv = handle.num_recv
        ptr = expert_out.data_ptr()
        if self.owned:      # the combine area holds what was written last
            if ptr == self._comb_addr and n_recv and handle.call != self._w[DW_LENT_COMB]:
                raise ValueError(
                    "expert_out is the combine buffer of another dispatch (or one a later "
                    "combine overwrote): with direct='owned' get_combine_buffer's tensor is "
                    "valid until the next combine or get_combine_buffer")
        # refused above before anything moved (a retry keeps this rank in step); from here on
        self._w[DW_C_EPOCH] = epoch = int(self._w[DW_C_EPOCH]) + 1
        self.dropped = []
        if b.members is not None and b.members.members.any_inactive:
            self._proxy_done()
        if self.owned:
            # a tensor in a lent area (a recv_x the caller holds) is read where it lies
            lent = self._lent_lo <= ptr and ptr + n_recv * rb <= self._lent_hi
            copied = n_recv > 0 and ptr != self._comb_addr and not lent
            self._w[DW_LENT_COMB] = 0
        else:
            copied = n_recv > 0 and ptr not in (self._recv_addr, self._comb_addr)
        offset = (self._comb_addr if copied or not n_recv else ptr) - b.base
        weighted = bool(weighted)
        return self._combine_from(handle, expert_out, dest, epoch, code, ecode, lut, es, rb,
                                  offset, ptr, n_recv, copied, weighted, t0)

    def _combine_from(self, handle, expert_out, dest, epoch, code, ecode, lut, es, rb, offset,
                      ptr, n_recv, copied, weighted, t0) -> CombineResult:
        """`combine` once it has told where my expert outputs lie."""
        return self._combine_rest(handle, expert_out, dest, epoch, code, ecode, lut, es, rb,
                                  offset, ptr, n_recv, copied, weighted, t0, None)

    def _combine_rest(self, handle, expert_out, dest, epoch, code, ecode, lut, es, rb, offset,
                      ptr, n_recv, copied, weighted, t0, begun) -> CombineResult:
        """`combine` from its first kernel entry on (`begun`: what the compiled entry returned
        when it ran that entry already)."""
        deadline = deadline_after(t0, self._timeout_s)
        out, t1, waiting, ivs = self._sums(handle, expert_out, dest, epoch, code, ecode, lut,
                                           es, rb, offset, ptr, n_recv, copied, weighted,
                                           deadline, begun)
        if waiting:
            self._done_reading(epoch, deadline, waiting)
        if dest is not None and out is not dest:
            out = dest.copy_(out)
        t2 = now_us()
        stats = DeferredStats.of(self._combine_stats, (t0, t1, t2), ivs, copied,
                                 handle.topk_idx, rb, epoch)
        return new_combine_result(out, stats)

    def _sums(self, handle, expert_out, dest, epoch, code, ecode, lut, es, rb, offset, ptr,
              n_recv, copied, weighted, deadline, begun) -> tuple:
        """My tokens summed as their rows' ranks publish: (out, t1, ranks not done reading
        mine (-1: not told yet), the workers' intervals or None)."""
        out, t1, waiting = self._combine_one(handle, expert_out, dest, epoch, code, ecode, lut,
                                             es, rb, offset, ptr, n_recv if copied else 0,
                                             weighted, deadline, begun)
        return out, t1, waiting, None

    def _combine_one(self, handle: DispatchHandle, expert_out: torch.Tensor,
                     dest: torch.Tensor | None, epoch: int, code: int, ecode: int,
                     lut: np.ndarray, es: int, rb: int, offset: int, ptr: int, copy_n: int,
                     weighted: bool, deadline: float,
                     begun: tuple | None = None) -> tuple[torch.Tensor, float, int]:
        """One worker: copy in (`copy_n` rows: those peers read), publish, sum and, when every
        token was summed there, tell the peers I am done reading, in one kernel entry (bf16,
        fp16 and fp32 sums land in the output itself, a caller's row-major `dest` included);
        `(y, time published, ranks not done reading mine or -1: not told yet)`. `begun`: what
        the compiled entry returned, which ran that kernel entry already."""
        b = self.ctx
        dtype = expert_out.dtype
        idx_addr, w_addr, k_n, _, pos_addr, _, ints = handle.state
        t_n, hidden = handle.num_tokens, self.hidden
        own = ptr if copy_n else 0      # copied: my own rows are summed from expert_out itself
        rounded = dtype in ROUNDED
        sums = rounded or dtype is torch.float32    # into the output itself
        if begun is not None:           # the compiled entry ran the kernel entry below
            left, waiting, out, t1 = begun
        else:           # no ubep.native, or fp8 (fp32 sums in scratch, cast below)
            out = self._combine_out(dest, t_n, rb, dtype) if sums else None
            left, waiting = DK.combine_begin_at(
                b.bases, self.dlay, b.rank, epoch, code, offset, ptr, copy_n, ints[0], idx_addr,
                w_addr, t_n, k_n, weighted, pos_addr, self.el, rb, es, ecode, lut, self._ready,
                self._done_t, self._y_addr if dtype is not torch.float32 else out.data_ptr(),
                out.data_ptr() if rounded else 0, hidden, INLINE_SPINS,
                self._done_mine, self._done_first)
            t1 = now_us()
        if left < 0:
            raise self._combine_dtype_error(dtype, -left - 1)
        ready, done = self._ready, self._done_t
        if left:
            y_addr = out.data_ptr() if dtype is torch.float32 else self._y_addr
            out_addr = out.data_ptr() if rounded else 0
            bad = [-1]                  # a rank that published another dtype
            cur = [idx_addr, handle.topk_idx]    # elastic: the routing without dead ranks

            def poll(s: int) -> int:
                r = DK.reduce_direct_at(b.bases, self.dlay, epoch, cur[0], w_addr, t_n, k_n,
                                        weighted, pos_addr, self.el, rb, es, code, ecode,
                                        lut, ready, done, y_addr, out_addr, hidden, b.rank,
                                        own, s)
                if r < 0:
                    bad[0] = -r - 1
                    return 0
                return r

            b.wait(poll, "combine/rows",
                   lambda: self._reduce_missing(cur[1].numpy(), ready, done, 0, t_n),
                   deadline=deadline,
                   on_inactive=lambda: self._drop_ready(handle, cur, self.dropped))
            if bad[0] >= 0:
                raise self._combine_dtype_error(dtype, bad[0])
        if out is None:                                  # fp8: cast from the fp32 sums
            out = cast_rows(self._y[:t_n], dtype)
        return out, t1, waiting

    def _combine_out(self, dest: torch.Tensor | None, t_n: int, rb: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
        """Where bf16/fp16/fp32 sums land: a caller's row-major `dest`, a pooled block (owned,
        large), else a new tensor (None: the compiled entry makes it; a `dest` that is not
        row-major gets the sums copied in afterwards)."""
        if dest is not None and dest.is_contiguous():
            return dest
        if self.owned and t_n * rb >= self._lend.min_bytes:
            return self._lend.empty(t_n, self.hidden, dtype)
        return self._new_out(t_n, dtype)

    def _new_out(self, t_n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new output for `_combine_out` (None: the compiled entry makes it)."""
        return torch.empty(t_n, self.hidden, dtype=dtype)

    def _done_reading(self, epoch: int, deadline: float, left: int = -1) -> None:
        """Tell every rank I read all I needed of combine `epoch`; wait until every rank has
        read all it needed of mine (my expert outputs are then the caller's again). `left`
        >= 0: they were told already (`combine_begin_at`) and `left` ranks were not done."""
        b = self.ctx
        first, world = self._done_first, b.world
        if left < 0:
            left = DK.done_reading(self._done_mine, first, world, epoch, INLINE_SPINS)
        if not left:
            return
        b.wait(lambda s: poll_words_at_least(first, world, epoch, s), "combine/done",
               lambda: [r for r in range(world) if int(self._done[r]) < epoch],
               deadline=deadline, on_inactive=self._proxy_done)

    def _reduce_missing(self, idx: np.ndarray, ready: np.ndarray, done: np.ndarray, lo: int,
                        hi: int) -> list[int]:
        """Ranks whose outputs tokens [lo, hi) still wait for (for the timeout message)."""
        return sorted({int(e) // self.el for t in range(lo, hi) if not done[t]
                       for e in idx[t] if e >= 0 and ready[int(e) // self.el] < 0})

    def _combine_dtype_error(self, dtype: torch.dtype, rank: int) -> Exception:
        return _protocol_error(
            f"rank {self.ctx.rank} combines {dtype} rows but rank {rank} published another "
            f"dtype; every rank must pass the same dtype")

    def _combine_stats(self, ts, ivs, copied: bool, topk_idx: torch.Tensor, rb: int,
                       epoch: int) -> Stats:
        t0, t1, t2 = ts
        n_recv = int(np.count_nonzero(topk_idx.numpy() >= 0))
        r = self.ctx.rank
        first = "copy_in" if copied else "publish"
        intervals = self._intervals(Interval(r, 0, first, t0, t1), "reduce", t2, ivs)
        return Stats(op="combine", backend="shm", mode="ubep", sync="row-flag",
                     schedule="static", rank=r, total_us=t2 - t0,
                     phases_us={first: t1 - t0, "reduce": t2 - t1}, intervals=intervals,
                     bytes_sent=0, bytes_recv=n_recv * rb, payload_efficiency=1.0,
                     extra={"epoch": epoch, "workers": self.ctx.workers,
                            "direct": self.ctx.config.direct, "in_place": not copied})
