"""The one-worker path: a rank's whole call in the calling thread, in few kernel entries.

With one worker the roles of the pool path run in their dependency order in one thread:
counts first, then rows (+ sw/dc batch flags), then the wait for every source's counts,
CalCumSum, and reordering as rows are seen complete. Combine: rows back, then each token
summed once its slots arrived. Mode "bsp" keeps the baseline's order (rows, then flags and
counts) without barriers (there is no other worker to wait for).

Tensors reach the kernels by address (`data_ptr()`, a fraction of a microsecond where a
numpy view costs microseconds); the handle keeps them alive. Scratch arrays are made once
and reused; stats become objects only when read (`DeferredStats`). With `ubep.native` built,
`Buffer`'s common call skips this file: its door (`native/staged.cpp`) runs the same kernels
(`entries.py`) and comes back here only to wait or to name an error
(`dispatch_resume`, `combine_resume`).
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
from ubep.native import layout as L
from ubep.native import load_native
from ubep.native.layout import CAST_16, CAST_NONE, STAGED_DOOR, SW_C_EPOCH, SW_D_EPOCH, SW_LEN
from ubep.options import BufferConfig
from ubep.plan import WorkerMapper
from ubep.plan.blocks import BlockFormat
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.elements import cast_rows, combine_elem
from ubep.runtime.shm.inactive import (
    drop_partial,
    mark_dropped,
    proxy_counts,
    proxy_hellos,
    tokens_on,
)
from ubep.runtime.shm.outputs import OutputPool
from ubep.runtime.shm.protocol import DTYPE_CODES, check_peers_meta, dc_detail, sentinel_error
from ubep.runtime.shm.region import L_DROWS, L_EL, L_KMAX, META_BYTES, next_epoch
from ubep.runtime.shm.staged import kernels as KS
from ubep.runtime.shm.waits import INLINE_SPINS, SPINS, deadline_after, now_us
from ubep.stats import DeferredStats, Interval, Stats


class SinglePath:
    """Dispatch and combine of a rank with one worker."""

    def __init__(self, ctx: ShmContext, mapper: WorkerMapper):
        self.ctx = ctx
        c = ctx.config
        w, el = ctx.world, c.experts_per_rank
        self._mapper = mapper                  # the planner's per-worker mapper, one worker
        self._bsp = c.mode == "bsp"
        #: the state this path shares with its compiled door (`ubep.native.layout`'s SW_*
        #: words): its dispatch and combine epochs
        self._w = np.zeros(SW_LEN, np.int64)
        #: elastic: ranks whose rows the latest combine dropped (`inactive.py`)
        self.dropped: list[int] = []
        # scratch, kept: the path allocates nothing it can reuse
        self._y = np.zeros(c.max_tokens_per_rank * c.hidden, np.float32)   # fp32 sums
        self._y_addr = self._y.ctypes.data
        self._timeout_s = c.timeout_s
        # rows seen / tokens summed (kept; the kernels reset the part a call uses)
        self._done_rows = np.zeros(max(w * int(ctx.lay[L_DROWS]), 1), np.uint8)
        self._done_tokens = np.zeros(max(c.max_tokens_per_rank, 1), np.uint8)
        self._lend = OutputPool()          # recv_x and combine outputs: no page faults
        # my rows for myself skip my window: which (t, k) each of my window rows is (dispatch),
        # which received row each of my slots is (combine)
        self._mine = np.zeros(max(int(ctx.lay[L_DROWS]), 1), np.int64)
        self._row_of_slot = np.zeros(max(c.max_tokens_per_rank * int(ctx.lay[L_KMAX]), 1),
                                     np.int64)
        # the small state and the addresses of all the above: one array the kernels take by
        # address (`KS.state_array`; it points at arrays this path and `ctx` keep)
        self._state = KS.state_array(
            w, el, base=ctx.base, bases=ctx.bases, lay=ctx.lay, me=ctx.rank, bsp=self._bsp,
            done_rows=self._done_rows, done_tokens=self._done_tokens, mine=self._mine,
            row_of_slot=self._row_of_slot, rank_of_expert=mapper.rank_of_expert,
            hop_of_rank=mapper.hop_of_rank, kind=mapper.kind,
            num_hop_classes=mapper.num_hop_classes)
        self._state_addr = self._state.ctypes.data
        (self._cs, self._rc, self._meta, self._got, self._out_start, self._batch, self._hello,
         self._res) = KS.state_views(self._state_addr, w, el)   # res: `KS.RES_*`

    def release_outputs(self) -> None:
        """Drop the output pool's kept blocks (at close; tensors lent out stay valid)."""
        self._lend.close()

    # -- the door ---------------------------------------------------------------------------
    #: `ubep_native`'s entries for `door`'s tuple (`Buffer` calls them)
    DOOR_ENTRIES = ("staged_door_dispatch", "staged_door_combine")

    def door(self, lock, limits: tuple[int, int, int, int], buffer_words: np.ndarray,
             resume) -> tuple | None:
        """What `ubep.native`'s staged door (`native/staged.cpp`) reads to take a `Buffer`'s
        common call whole (`layout.STAGED_DOOR`): this path's state words and kept objects
        and constants, the Buffer's `lock`, its state words and `limits` its fast checks'
        (hidden, num_experts, max_tokens_per_rank, max_top_k), and `resume`, where a call
        that must wait goes on. None where `ubep.native` is not built."""
        native = load_native()
        if native is None:
            return None
        from ubep.runtime.shm.staged import entries as SE

        ctx, c = self.ctx, self.ctx.config
        return L.door(STAGED_DOOR, path_words=self._w, buffer_words=buffer_words, lock=lock,
                      resume=resume, codes=dict(DTYPE_CODES),
                      elems={d: _combine_elem(d) for d in (torch.bfloat16, torch.float16,
                                                               torch.float32)},
                      dbuild=functools.partial(_dispatch_stats, c, ctx.fmt, ctx.rank),
                      cbuild=functools.partial(_combine_stats, c, ctx.fmt, ctx.rank),
                      lend=self._lend.empty,
                      state=self._state_addr, y=self._y_addr, buffer_id=ctx.buffer_id,
                      world=ctx.world, el=c.experts_per_rank, spins=INLINE_SPINS,
                      min_lent=self._lend.min_bytes,
                      begin=SE.dispatch_begin_c.address, rows=SE.dispatch_rows_c.address,
                      cbegin=SE.combine_begin_c.address, cpoll=SE.combine_poll_c.address,
                      hidden=limits[0], experts=limits[1], max_tokens=limits[2],
                      max_top_k=limits[3])

    def dispatch_resume(self, r: tuple, x: torch.Tensor, topk_idx: torch.Tensor,
                        topk_weights: torch.Tensor, call: int, t0: float,
                        epoch: int) -> DispatchResult:
        """The rest of a dispatch the door began and stopped at a wait or a check, `r` what
        it made: `(tpe, left)` after the send (counts missing, or something to check),
        `(tpe, recv_x, ints, wts, t1)` after a first look at the rows."""
        if len(r) == 2:
            tpe, left = r
            return self._dispatch_rest(x, topk_idx, topk_weights, call, t0, epoch, tpe, left)
        tpe, recv_x, ints, wts, t1 = r
        return self._dispatch_end(x, topk_idx, topk_weights, call, t0, epoch, tpe, recv_x, ints,
                                  wts, (t1, t1), 1)

    def combine_resume(self, r: tuple, expert_out: torch.Tensor, handle: DispatchHandle,
                       weighted: bool, t0: float, epoch: int) -> CombineResult:
        """The rest of a combine the door began, `r` what it made: `(bad,)` after an sp
        sentinel abort of the send, `(left, out, t1)` after a first poll (tokens missing,
        or the peers' hellos to check)."""
        if len(r) == 1:
            raise sentinel_error("expert_out", -r[0] - 1)
        left, out, t1 = r
        self.dropped = []
        return self._combine_end(expert_out, handle, weighted, t0, epoch, out, out, t1, left)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int, t0: float) -> DispatchResult:
        """Send and a first look at the counts in one kernel entry, then the outputs, then
        the rows."""
        self._w[SW_D_EPOCH] = epoch = next_epoch(int(self._w[SW_D_EPOCH]))
        tpe = np.empty(self.ctx.config.experts_per_rank, np.int64)
        if self.ctx.members is not None and self.ctx.members.members.any_inactive:
            proxy_counts(self.ctx, epoch, DTYPE_CODES[x.dtype])
        left = KS.dispatch_begin_at(self._state_addr, epoch, x.data_ptr(), x.shape[0],
                                    x.shape[1] * x.element_size(), topk_idx.data_ptr(),
                                    topk_idx.shape[1], topk_weights.data_ptr(),
                                    DTYPE_CODES[x.dtype], tpe, 1)
        return self._dispatch_rest(x, topk_idx, topk_weights, call, t0, epoch, tpe, left)

    def _dispatch_rest(self, x: torch.Tensor, topk_idx: torch.Tensor,
                       topk_weights: torch.Tensor, call: int, t0: float, epoch: int,
                       tpe: np.ndarray, left: int) -> DispatchResult:
        """A dispatch once its rows and counts are sent: every source's counts, the outputs,
        a first look at the rows."""
        ctx = self.ctx
        res, got, world, state = self._res, self._got, ctx.world, self._state_addr
        elem = DTYPE_CODES[x.dtype]
        if left:
            t1 = now_us()
            ctx.wait(lambda s: KS.dispatch_counts_at(state, epoch, tpe, elem, s),
                     "dispatch/counts", lambda: [s for s in range(world) if not got[s]],
                     deadline=deadline_after(t0, self._timeout_s),
                     on_inactive=lambda: proxy_counts(ctx, epoch, elem))
            t2 = now_us()
        else:
            t1 = t2 = now_us()
        n_sends, code, n_recv, _ = res.tolist()
        if n_sends < 0:
            raise sentinel_error("x", -n_sends - 1)
        if code:
            check_peers_meta(self._meta, elem, ctx.rank, "dispatch")
        num_tokens, hidden = x.shape
        recv_x = self._lend.empty(n_recv, hidden, x.dtype)
        ints = np.empty((3, n_recv), np.int64)
        wts = np.empty(n_recv, np.float32)
        # the first poll inline: when every row is already there (one rank, or peers ahead of
        # us) the bounded wait and its closures are not built at all
        left = KS.recv_rows_at(state, epoch, n_recv, recv_x.data_ptr(),
                               hidden * x.element_size(), wts, ints, x.data_ptr(), num_tokens,
                               topk_weights.data_ptr(), topk_idx.shape[1], SPINS)
        return self._dispatch_end(x, topk_idx, topk_weights, call, t0, epoch, tpe, recv_x, ints,
                                  wts, (t1, t2), left)

    def _dispatch_end(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      call: int, t0: float, epoch: int, tpe: np.ndarray, recv_x: torch.Tensor,
                      ints: np.ndarray, wts: np.ndarray, ts: tuple[float, float],
                      left: int) -> DispatchResult:
        """A dispatch once its outputs are made: the rows still missing (`left`), then the
        result (`ts`: when the counts wait began and ended)."""
        ctx = self.ctx
        num_tokens, hidden = x.shape
        n_recv, rb, top_k = recv_x.shape[0], hidden * x.element_size(), topk_idx.shape[1]
        idx_addr, w_addr = topk_idx.data_ptr(), topk_weights.data_ptr()
        dropped: list[int] = []
        if left:
            state, x_addr, src_addr = self._state_addr, recv_x.data_ptr(), x.data_ptr()
            rc, done, batch = self._rc, self._done_rows, self._batch
            ctx.wait(lambda s: KS.recv_rows_at(state, epoch, n_recv, x_addr, rb, wts, ints,
                                               src_addr, num_tokens, w_addr, top_k, s),
                     "dispatch/rows", lambda: missing_sources(rc, done, 0, n_recv),
                     lambda: dc_detail(batch), deadline=deadline_after(t0, self._timeout_s),
                     on_inactive=lambda: drop_partial(ctx, rc, done[:n_recv], dropped))
            if dropped:
                mark_dropped(ints, rc, self._out_start, dropped)
        t3 = now_us()
        handle = new_handle(ctx.buffer_id, call, num_tokens, n_recv, hidden, topk_idx,
                            topk_weights, ints, (idx_addr, w_addr, top_k, ints))
        stats = DeferredStats.of(_dispatch_stats, ctx.config, ctx.fmt, ctx.rank,
                                 (t0, *ts, t3), int(self._res[KS.RES_SENDS]), n_recv, rb,
                                 epoch)
        res = new_dispatch_result(recv_x, wts, tpe, handle, stats)
        if dropped:
            res.__dict__["_dropped"] = dropped
        return res

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                t0: float, dest: torch.Tensor | None = None) -> CombineResult:
        """Rows back in one kernel entry, then sum (and round to bf16/fp16) in the poll: fp32
        sums land in the output itself, 16-bit ones are rounded into it; by address."""
        dtype = expert_out.dtype
        num_tokens, hidden = handle.num_tokens, handle.hidden
        self._w[SW_C_EPOCH] = epoch = next_epoch(int(self._w[SW_C_EPOCH]))
        self.dropped = []
        if self.ctx.members is not None and self.ctx.members.members.any_inactive:
            proxy_hellos(self.ctx, epoch, DTYPE_CODES[dtype])
        # the kernels write by address: a caller's row-major `dest` takes the sums directly
        into = dest if dest is not None and dest.is_contiguous() else None
        out = None
        if dtype is torch.float32 or dtype is torch.bfloat16 or dtype is torch.float16:
            out = into if into is not None else self._lend.empty(num_tokens, hidden, dtype)
        bad = KS.combine_begin_at(self._state_addr, epoch, expert_out.data_ptr(),
                                  handle.num_recv, hidden * expert_out.element_size(),
                                  handle.state[3], DTYPE_CODES[dtype], num_tokens)
        if bad < 0:
            raise sentinel_error("expert_out", -bad - 1)
        t1 = now_us()
        left = self._combine_poll(expert_out, handle, weighted, epoch, out, SPINS)
        return self._combine_end(expert_out, handle, weighted, t0, epoch, out, dest, t1, left)

    def _combine_poll(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                      epoch: int, out: torch.Tensor | None, spins: int) -> int:
        """One look at the rows back: tokens summed whose rows all arrived, fp32 sums into
        `out` (fp32) or the kept sums (`out` None: fp8), 16-bit ones rounded into `out`.
        Returns what is still missing."""
        dtype = expert_out.dtype
        idx_addr, w_addr, top_k, _ = handle.state
        elem, ecode, lut_addr, n_lut = _combine_elem(dtype)
        es = expert_out.element_size()
        cast, out_addr, y_addr = CAST_NONE, 0, self._y_addr
        if dtype is torch.float32:                     # sum in place, no cast
            y_addr = out.data_ptr()
        elif out is not None:                          # 16-bit: the poll rounds into it
            cast, out_addr = CAST_16, out.data_ptr()
        return KS.combine_poll_at(self._state_addr, epoch, idx_addr, w_addr, handle.num_tokens,
                                  top_k, bool(weighted), handle.hidden * es, es, ecode, lut_addr,
                                  n_lut, y_addr, handle.hidden, spins, elem, cast, out_addr,
                                  expert_out.data_ptr())

    def _combine_end(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                     t0: float, epoch: int, out: torch.Tensor | None,
                     dest: torch.Tensor | None, t1: float, left: int) -> CombineResult:
        """A combine after its first poll: the tokens still missing (`left`), the peers'
        hellos checked, then the result."""
        ctx = self.ctx
        dtype = expert_out.dtype
        if left:
            batch, done = self._batch, self._done_tokens
            cur = [handle]          # elastic: the routing without dead ranks, once found
            deadline = deadline_after(t0, self._timeout_s)
            ctx.wait(lambda s: self._combine_poll(expert_out, cur[0], weighted, epoch, out, s),
                     "combine/rows", lambda: self._combine_missing(cur[0], done),
                     lambda: dc_detail(batch), deadline=deadline,
                     on_inactive=lambda: self._drop_sources(cur, epoch, DTYPE_CODES[dtype]))
            if self.dropped:        # no token keeps a row of a rank dropped meanwhile
                again = tokens_on(handle.topk_idx.numpy(), self.dropped,
                                  ctx.config.experts_per_rank)
                done[again] = 0
                ctx.wait(lambda s: self._combine_poll(expert_out, cur[0], weighted, epoch, out,
                                                      s),
                         "combine/rows", lambda: self._combine_missing(cur[0], done),
                         lambda: dc_detail(batch), deadline=deadline)
        _, code, _, routed = self._res.tolist()
        if code:
            check_peers_meta(self._hello, DTYPE_CODES[dtype], ctx.rank, "combine")
        num_tokens, hidden = handle.num_tokens, handle.hidden
        if out is None:                                # fp8: rare, cast by torch/numpy
            out = cast_rows(self._y[:num_tokens * hidden].reshape(num_tokens, hidden), dtype)
        if dest is not None and out is not dest:
            out = dest.copy_(out)
        t2 = now_us()
        stats = DeferredStats.of(_combine_stats, ctx.config, ctx.fmt, ctx.rank, (t0, t1, t2),
                                 handle.num_recv, routed, handle.hidden * expert_out.element_size(),
                                 epoch)
        return new_combine_result(out, stats)

    # -- elastic (`Buffer(elastic=True)`, `inactive.py`) ------------------------------------------
    def _drop_sources(self, cur: list, epoch: int, elem: int) -> None:
        """Combine's rows: hellos for the inactive ranks, and `cur[0]` becomes the routing
        without them; `dropped` collects those this combine routed to."""
        proxy_hellos(self.ctx, epoch, elem)
        m = self.ctx.members.members
        gone = [r for r in m.inactive if r not in self.dropped]
        idx, hit = m.mask(cur[0].topk_idx, gone)
        if hit is not None:
            self.dropped.extend(gone)
            cur[0] = self.with_routing(cur[0], idx)

    def with_routing(self, handle: DispatchHandle, idx: torch.Tensor) -> DispatchHandle:
        """A copy of `handle` whose combine uses routing `idx` (masked)."""
        _, w_addr, top_k, ints = handle.state
        return rerouted(handle, idx, (idx.data_ptr(), w_addr, top_k, ints))

    def skip_epochs(self, n: int) -> None:
        """`set_active_ranks`: advance both epochs by `n` (even; see `DirectPath`)."""
        self._w[SW_D_EPOCH] += n
        self._w[SW_C_EPOCH] += n

    def _combine_missing(self, handle: DispatchHandle, done: np.ndarray) -> list[int]:
        """The ranks a combine still waits for (rows of unfinished tokens, hellos)."""
        el = int(self.ctx.lay[L_EL])
        idx, batch, got = handle.topk_idx.numpy(), self._batch, self._got
        want = {int(e) // el for t in range(handle.num_tokens) if not done[t]
                for e in idx[t] if e >= 0}
        if self.ctx.fmt.sync in ("sw", "dc"):
            want = {r for r in want if batch[r] != 1}
        return sorted(want | {s for s in range(self.ctx.world) if not got[s]})


def missing_sources(rc: np.ndarray, done: np.ndarray, lo: int, hi: int) -> list[int]:
    """Sources some of whose rows in [lo, hi) (source-major order) have not arrived."""
    ends = np.cumsum(rc.sum(1))
    starts = ends - rc.sum(1)
    return [s for s in range(rc.shape[0])
            if max(starts[s], lo) < min(ends[s], hi)
            and not done[max(starts[s], lo):min(ends[s], hi)].all()]


@functools.cache
def _combine_elem(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(dtype code, element code, address and length of the fp32 lookup table) of combine
    rows, once per dtype (the cache keeps the table alive)."""
    ecode, lut = combine_elem(dtype)
    _LUTS.append(lut)
    return DTYPE_CODES[dtype], ecode, lut.ctypes.data, lut.shape[0]


#: the lookup tables whose addresses `_combine_elem` handed out (kept for the process)
_LUTS: list[np.ndarray] = []


def _dispatch_stats(c: BufferConfig, fmt: BlockFormat, r: int, ts: tuple[float, ...],
                    n_sends: int, n_recv: int, rb: int, epoch: int) -> Stats:
    """The Stats of a one-worker dispatch from its timestamps (built on first read)."""
    t0, t1, t2, t3 = ts
    wire = fmt.wire_bytes(META_BYTES + rb)
    return Stats(op="dispatch", backend="shm", mode=c.mode, sync=c.sync,
                 schedule=c.schedule, rank=r, total_us=t3 - t0,
                 phases_us={"send": t1 - t0, "wait_counts": t2 - t1, "reorder": t3 - t2},
                 intervals=[Interval(r, 0, "send", t0, t1),
                            Interval(r, 0, "wait_counts", t1, t2, "wait"),
                            Interval(r, 0, "reorder", t2, t3)],
                 bytes_sent=n_sends * wire, bytes_recv=n_recv * wire,
                 payload_efficiency=fmt.efficiency(META_BYTES + rb),
                 extra={"epoch": epoch, "workers": 1})


def _combine_stats(c: BufferConfig, fmt: BlockFormat, r: int, ts: tuple[float, ...],
                   n_sent: int, n_recv: int, rb: int, epoch: int) -> Stats:
    """The Stats of a one-worker combine from its timestamps (built on first read)."""
    t0, t1, t2 = ts
    wire = fmt.wire_bytes(rb)
    return Stats(op="combine", backend="shm", mode=c.mode, sync=c.sync,
                 schedule=c.schedule, rank=r, total_us=t2 - t0,
                 phases_us={"send": t1 - t0, "reduce": t2 - t1},
                 intervals=[Interval(r, 0, "send", t0, t1),
                            Interval(r, 0, "reduce", t1, t2)],
                 bytes_sent=n_sent * wire, bytes_recv=n_recv * wire,
                 payload_efficiency=fmt.efficiency(rb),
                 extra={"epoch": epoch, "workers": 1})
