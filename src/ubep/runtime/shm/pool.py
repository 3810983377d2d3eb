"""The worker-pool path: a rank's call run by `workers` >= 2 threads in roles or phases.

* mode "ubep" (kernel decomposition): count workers send per-expert counts first; count
  worker 0 waits for every source's counts, computes the offsets (CalCumSum) and publishes
  them (release store); token workers send their rows, then reorder each received row as
  soon as the offsets are published and the row is seen complete. No barrier.
* mode "bsp" (the baseline): Token-Sending -> barrier -> Send-Flag-and-Count -> Flag
  verification -> barrier -> CalCumSum -> barrier -> Token-Reordering.

Combine writes each expert-output row back to its source's window at (token, slot); the
source sums a token as soon as all its slots arrived (ubep) or after the phases (bsp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.plan import make_plan
from ubep.plan.topology import Topology
from ubep.runtime.shm.call import Call, CallRunner
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.elements import cast_rows, combine_elem
from ubep.runtime.shm.kernels import combine as KC
from ubep.runtime.shm.kernels import dispatch as KD
from ubep.runtime.shm.kernels import sentinel as KP
from ubep.runtime.shm.kernels import slots as KS
from ubep.runtime.shm.protocol import (
    DTYPE_CODES,
    check_peers_meta,
    dc_detail,
    sentinel_error,
)
from ubep.runtime.shm.region import L_BB, L_EL, META_BYTES, STATUS_ABORT, STATUS_OK
from ubep.runtime.shm.single import missing_sources
from ubep.runtime.shm.waits import now_us
from ubep.stats import Interval, Stats


@dataclass(eq=False, kw_only=True)
class DispatchCall(Call):
    """One dispatch on the pool: its inputs, its plan, and what the workers fill in."""

    xb: np.ndarray                  # [T, row bytes] uint8, the rows to send
    idx: np.ndarray                 # [T, K] int64 topk_idx
    w: np.ndarray                   # [T, K] float32 topk_weights
    dtype: torch.dtype
    hidden: int
    elem: int                       # dtype code (`protocol.DTYPE_CODES`)
    n_tw: int                       # token workers
    n_count: int                    # count workers (0: one thread does everything)
    sends: list[np.ndarray]         # per token worker: [n_j, 3] (token, slot, dest rank)
    pos: list[np.ndarray]           # per token worker: [n_j] window positions
    counts: np.ndarray              # [E] my sends per global expert
    dest_ranges: list[tuple[int, int]]   # per count worker: [lo, hi) destination ranks
    rc: np.ndarray                  # [world, E/P] counts received from each source
    meta: np.ndarray                # [world, 3] each source's (token workers, dtype, status)
    got: np.ndarray                 # [world] int8: source's counts read
    cs: list[np.ndarray]            # per token worker: [world] dc checksum terms
    batch: np.ndarray               # [world] sw/dc batch state (see `recv_rows`)
    # set by CalCumSum (`_offsets`):
    n_recv: int = 0
    out_start: np.ndarray | None = None  # [world, E/P] output row of each (source, expert)
    done: np.ndarray | None = None       # [n_recv] uint8: row reordered
    recv_x: torch.Tensor | None = None
    recv_xb: np.ndarray | None = None    # recv_x as [n_recv, row bytes] uint8
    recv_w: np.ndarray | None = None     # [n_recv] float32
    tpe: np.ndarray | None = None        # [E/P] tokens per local expert
    ints: np.ndarray | None = None       # [3, n_recv] (source rank, token, slot)

    @property
    def rb(self) -> int:
        return self.xb.shape[1]


@dataclass(eq=False, kw_only=True)
class CombineCall(Call):
    """One combine on the pool: rows to send back, the routing, and the sums."""

    rows: np.ndarray                # [N, row bytes] uint8 expert outputs
    ints: np.ndarray                # [3, N] (source rank, token, slot) of each row
    idx: np.ndarray                 # [T, K] int64 my routing
    w: np.ndarray                   # [T, K] float32
    elem: int                       # dtype code
    ecode: int                      # element code (`kernels.combine.ELEM_*`)
    lut: np.ndarray                 # fp32 lookup table of ecode LUT8/LUT16
    weighted: bool
    es: int                         # element size, bytes
    y: np.ndarray                   # [T, hidden] float32 sums
    done: np.ndarray                # [T] uint8: token summed
    cs: list[np.ndarray] = field(default_factory=list)  # per worker: [world] dc checksums


class PoolPath:
    """Dispatch and combine of a rank with `workers` >= 2 threads."""

    def __init__(self, ctx: ShmContext, topology: Topology):
        self.ctx = ctx
        self.runner = CallRunner(ctx)
        self.topology = topology
        self._d_epoch = 0
        self._c_epoch = 0

    def _plan(self, topk_idx: torch.Tensor):
        """(token workers, count workers, per-token-worker sends and window positions,
        send_counts, count_dest_ranges) from the Plan of this call."""
        c = self.ctx.config
        p = make_plan(topk_idx, topology=self.topology, rank=self.ctx.rank,
                      num_experts=c.num_experts, workers=self.ctx.workers,
                      count_workers=c.count_workers, schedule=c.schedule, mode=c.mode)
        ws = [np.ascontiguousarray(s) for s in p.worker_sends]
        wp = [np.ascontiguousarray(s) for s in p.worker_window_pos]
        return (p.token_workers, p.count_workers, ws, wp, np.ascontiguousarray(p.send_counts),
                p.count_dest_ranges)

    def _stats(self, op: str, call: Call, t0: float, t1: float, record_bytes: int,
               sent: int, recv: int, extra: dict) -> Stats:
        ctx = self.ctx
        intervals = []
        phases: dict[str, list[float]] = {}
        for j, ivs in enumerate(call.iv):
            for name, a, b, kind in ivs:
                intervals.append(Interval(ctx.rank, j, name, a, b, kind))
                p = phases.get(name)
                if p is None:
                    phases[name] = [a, b]
                else:
                    p[0], p[1] = min(p[0], a), max(p[1], b)
        c = ctx.config
        wire = ctx.fmt.wire_bytes(record_bytes)
        return Stats(op=op, backend="shm", mode=c.mode, sync=c.sync, schedule=c.schedule,
                     rank=ctx.rank, total_us=t1 - t0,
                     phases_us={k: v[1] - v[0] for k, v in phases.items()},
                     intervals=intervals, bytes_sent=sent * wire, bytes_recv=recv * wire,
                     payload_efficiency=ctx.fmt.efficiency(record_bytes), extra=extra)

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int, t0: float) -> DispatchResult:
        ctx = self.ctx
        c = ctx.config
        world = ctx.world
        idx = topk_idx.numpy()
        w = topk_weights.numpy()
        num_tokens, top_k = idx.shape
        xb = x.view(torch.uint8).reshape(num_tokens, -1).numpy() if x.numel() else \
            np.zeros((num_tokens, x.shape[1] * x.element_size()), np.uint8)
        elem = DTYPE_CODES[x.dtype]
        n_tw, n_count, w_sends, w_pos, counts, dest_ranges = self._plan(topk_idx)
        t_plan = now_us()
        self._d_epoch += 1
        epoch = self._d_epoch
        n = ctx.workers if c.mode == "bsp" or n_count else 1
        if c.sync == "sp":
            for sends in w_sends:
                bad = KP.sp_check_dispatch(xb, w, sends, int(ctx.lay[L_BB]))
                if bad >= 0:
                    KS.send_counts(ctx.bases, ctx.lay, ctx.rank, epoch, counts, n_tw, elem,
                                   STATUS_ABORT, 0, world)
                    raise sentinel_error("x", int(sends[bad, 0]))
        el = c.experts_per_rank
        cl = self.runner.start(DispatchCall(
            epoch=epoch, deadline=ctx.deadline(), n=n, xb=xb, idx=idx, w=w, dtype=x.dtype,
            hidden=x.shape[1], elem=elem, n_tw=n_tw, n_count=n_count, sends=w_sends,
            pos=w_pos, counts=counts, dest_ranges=dest_ranges, rc=np.zeros((world, el), np.int64),
            meta=np.full((world, 3), -1, np.int64), got=np.zeros(world, np.int8),
            cs=[np.zeros(world, np.int64) for _ in range(max(n_tw, 1))],
            batch=np.zeros(world, np.int64)))
        cl.iv[0].append(("plan", t0, t_plan, "busy"))
        if c.mode == "bsp":
            self.runner.run(cl, lambda j: self._dispatch_bsp(cl, j))
        else:
            self.runner.run(cl, lambda j: self._dispatch_ubep(cl, j))
        t1 = now_us()
        ints = cl.ints
        src_rank, src_tok, src_slot = (torch.from_numpy(ints[0]), torch.from_numpy(ints[1]),
                                       torch.from_numpy(ints[2]))
        handle = DispatchHandle(
            buffer_id=ctx.buffer_id, call=call, num_tokens=num_tokens, num_recv=cl.n_recv,
            hidden=x.shape[1], topk_idx=topk_idx, topk_weights=topk_weights,
            recv_src_rank=src_rank, recv_src_token=src_tok, recv_src_slot=src_slot,
            state=(idx, w, ints, epoch))
        extra = {"epoch": epoch, "workers": n, "token_workers": n_tw, "count_workers": n_count,
                 "block_bytes": c.block_bytes}
        stats = self._stats("dispatch", cl, t0, t1, META_BYTES + cl.rb,
                            sum(len(s) for s in w_sends), cl.n_recv, extra)
        return DispatchResult(
            recv_x=cl.recv_x, recv_weights=torch.from_numpy(cl.recv_w),
            tokens_per_expert=torch.from_numpy(cl.tpe), recv_src_rank=src_rank,
            recv_src_token=src_tok, recv_src_slot=src_slot, handle=handle, stats=stats)

    def _send_counts(self, cl: DispatchCall, j: int, lo: int, hi: int) -> None:
        ctx = self.ctx
        a = now_us()
        KS.send_counts(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.counts, cl.n_tw, cl.elem,
                       STATUS_OK, lo, hi)
        cl.record(j, "send_counts", a)

    def _send_rows(self, cl: DispatchCall, j: int, tj: int, flags: bool) -> None:
        ctx = self.ctx
        a = now_us()
        cs = cl.cs[tj]
        KD.send_rows(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.xb, cl.idx, cl.w, cl.sends[tj],
                     cl.pos[tj], cl.counts, cs)
        if flags and ctx.fmt.sync in ("sw", "dc"):
            KS.write_batch_flags(ctx.bases, ctx.lay, 0, ctx.rank, cl.epoch, tj, cs,
                                 ctx.dc_corrupt)
        cl.record(j, "send_rows", a)

    def _poll_counts(self, cl: DispatchCall, j: int, lo: int, hi: int) -> None:
        ctx = self.ctx
        a = now_us()
        rc, meta, got = cl.rc, cl.meta, cl.got
        self.runner.wait(cl, lambda s: KS.poll_counts(ctx.base, ctx.lay, cl.epoch, lo, hi, rc,
                                                      meta, got, s),
                         "dispatch/counts", lambda: [s for s in range(lo, hi) if not got[s]])
        cl.record(j, "wait_counts", a, "wait")

    def _offsets(self, cl: DispatchCall, j: int) -> None:
        """CalCumSum: offsets of every (source, expert) run; allocate the outputs."""
        ctx = self.ctx
        a = now_us()
        check_peers_meta(cl.meta, cl.elem, ctx.rank, "dispatch")
        el = ctx.config.experts_per_rank
        out_start = np.empty((ctx.world, el), np.int64)
        tpe = np.empty(el, np.int64)
        n_recv = KD.offsets(cl.rc, out_start, tpe)
        rb = cl.rb
        recv_x = torch.empty((n_recv, cl.hidden), dtype=cl.dtype)
        cl.n_recv, cl.out_start, cl.tpe = n_recv, out_start, tpe
        cl.done = np.zeros(n_recv, np.uint8)
        cl.ints = np.empty((3, n_recv), np.int64)
        cl.recv_w = np.empty(n_recv, np.float32)
        cl.recv_x = recv_x
        cl.recv_xb = recv_x.view(torch.uint8).reshape(n_recv, rb).numpy() if n_recv and rb \
            else np.zeros((n_recv, rb), np.uint8)
        cl.record(j, "offsets", a)

    def _recv(self, cl: DispatchCall, j: int, part: int, parts: int) -> None:
        ctx = self.ctx
        a = now_us()
        n_recv = cl.n_recv
        lo, hi = part * n_recv // parts, (part + 1) * n_recv // parts
        if hi > lo:
            ints = cl.ints
            rc, meta, out_start, done = cl.rc, cl.meta, cl.out_start, cl.done
            batch = cl.batch if parts == 1 else np.zeros(ctx.world, np.int64)
            self.runner.wait(
                cl, lambda s: KD.recv_rows(ctx.base, ctx.lay, cl.epoch, rc, meta, out_start, lo,
                                           hi, done, batch, cl.recv_xb, cl.recv_w, ints[0],
                                           ints[1], ints[2], s),
                "dispatch/rows", lambda: missing_sources(rc, done, lo, hi),
                lambda: dc_detail(batch))
        cl.record(j, "reorder", a)

    def _dispatch_ubep(self, cl: DispatchCall, j: int) -> None:
        world = self.ctx.world
        if cl.n_count == 0:                    # one thread, dependency order
            self._send_counts(cl, 0, 0, world)
            self._send_rows(cl, 0, 0, True)
            self._poll_counts(cl, 0, 0, world)
            self._offsets(cl, 0)
            self._recv(cl, 0, 0, 1)
        elif j < cl.n_count:                   # count role
            lo, hi = cl.dest_ranges[j]
            self._send_counts(cl, j, lo, hi)
            if j == 0:
                self._poll_counts(cl, j, 0, world)
                self._offsets(cl, j)
                self.runner.publish(cl)
        else:                                  # token role
            tj = j - cl.n_count
            self._send_rows(cl, j, tj, True)
            a = now_us()
            self.runner.wait_published(cl, "dispatch/offsets")
            cl.record(j, "wait_offsets", a, "wait")
            self._recv(cl, j, tj, cl.n_tw)

    def _dispatch_bsp(self, cl: DispatchCall, j: int) -> None:
        ctx = self.ctx
        n, world = cl.n, ctx.world
        self._send_rows(cl, j, j, False)                    # Token-Sending
        self.runner.barrier(cl, 1, "dispatch")
        if j == 0:                                          # Send-Flag-and-Count
            a = now_us()
            if ctx.fmt.sync in ("sw", "dc"):
                for tj in range(cl.n_tw):
                    KS.write_batch_flags(ctx.bases, ctx.lay, 0, ctx.rank, cl.epoch, tj,
                                         cl.cs[tj], ctx.dc_corrupt)
            cl.record(0, "send_flags", a)
            self._send_counts(cl, 0, 0, world)
        lo, hi = j * world // n, (j + 1) * world // n       # Flag verification
        if hi > lo:
            self._poll_counts(cl, j, lo, hi)
        self.runner.barrier(cl, 2, "dispatch")
        if j == 0:
            self._offsets(cl, 0)                            # CalCumSum
        self.runner.barrier(cl, 3, "dispatch")
        self._recv(cl, j, j, n)                             # Token-Reordering

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                t0: float) -> CombineResult:
        ctx = self.ctx
        c = ctx.config
        world = ctx.world
        dtype = expert_out.dtype
        idx, w, ints, _ = handle.state
        n_recv = handle.num_recv
        hidden = handle.hidden
        rows = expert_out.view(torch.uint8).reshape(n_recv, -1).numpy() if expert_out.numel() \
            else np.zeros((n_recv, hidden * expert_out.element_size()), np.uint8)
        elem = DTYPE_CODES[dtype]
        self._c_epoch += 1
        epoch = self._c_epoch
        n = ctx.workers
        if c.sync == "sp":
            bad = KP.sp_check_rows(rows, int(ctx.lay[L_BB]))
            if bad >= 0:
                KS.send_hello(ctx.bases, ctx.lay, ctx.rank, epoch, n, elem, STATUS_ABORT)
                raise sentinel_error("expert_out", bad)
        ecode, lut = combine_elem(dtype)
        num_tokens = idx.shape[0]
        cl = self.runner.start(CombineCall(
            epoch=epoch, deadline=ctx.deadline(), n=n, rows=rows, ints=ints, idx=idx, w=w,
            elem=elem, ecode=ecode, lut=lut, weighted=bool(weighted),
            es=expert_out.element_size(), y=np.zeros((num_tokens, hidden), np.float32),
            done=np.zeros(num_tokens, np.uint8),
            cs=[np.zeros(world, np.int64) for _ in range(n)]))
        if c.mode == "bsp":
            self.runner.run(cl, lambda j: self._combine_bsp(cl, j))
        else:
            self.runner.run(cl, lambda j: self._combine_ubep(cl, j))
        y = cast_rows(cl.y, dtype)
        t1 = now_us()
        stats = self._stats("combine", cl, t0, t1, rows.shape[1], n_recv,
                            int((idx >= 0).sum()), {"epoch": epoch, "workers": n})
        return CombineResult(y=y, stats=stats)

    def _c_send(self, cl: CombineCall, j: int, flags: bool) -> None:
        ctx = self.ctx
        a = now_us()
        n_recv = cl.rows.shape[0]
        lo, hi = j * n_recv // cl.n, (j + 1) * n_recv // cl.n
        ints, cs = cl.ints, cl.cs[j]
        KC.send_back(ctx.bases, ctx.lay, cl.epoch, cl.rows, ints[0], ints[1], ints[2], lo, hi,
                     cs)
        if flags and ctx.fmt.sync in ("sw", "dc"):
            KS.write_batch_flags(ctx.bases, ctx.lay, 1, ctx.rank, cl.epoch, j, cs,
                                 ctx.dc_corrupt)
        cl.record(j, "send_rows", a)

    def _c_hello(self, cl: CombineCall, j: int) -> None:
        ctx = self.ctx
        a = now_us()
        KS.send_hello(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.n, cl.elem, STATUS_OK)
        cl.record(j, "send_flags", a)

    def _c_reduce(self, cl: CombineCall, j: int, need_all_hellos: bool) -> None:
        """Sum my tokens' rows as they arrive; also collect every peer's hello."""
        ctx = self.ctx
        world = ctx.world
        a = now_us()
        num_tokens = cl.idx.shape[0]
        tlo, thi = j * num_tokens // cl.n, (j + 1) * num_tokens // cl.n
        hello = np.full((world, 3), -1, np.int64)
        got = np.zeros(world, np.int8)
        batch = np.zeros(world, np.int64)
        checked = [False]

        def poll(s: int) -> int:
            missing = KS.poll_hello(ctx.base, ctx.lay, cl.epoch, hello, got, 1)
            if missing == 0 and not checked[0]:
                check_peers_meta(hello, cl.elem, ctx.rank, "combine")
                checked[0] = True
            rem = KC.reduce_tokens(ctx.base, ctx.lay, cl.epoch, cl.idx, cl.w, cl.weighted,
                                   cl.rows.shape[1], cl.es, cl.ecode, cl.lut, hello, tlo, thi,
                                   cl.done, batch, cl.y, s)
            return rem + (missing if need_all_hellos else 0)

        def peers() -> list[int]:
            el = int(ctx.lay[L_EL])
            idx, done = cl.idx, cl.done
            want = {int(e) // el for t in range(tlo, thi) if not done[t]
                    for e in idx[t] if e >= 0}
            if ctx.fmt.sync in ("sw", "dc"):   # batch-granular: the ranks not complete
                want = {r for r in want if batch[r] != 1}
            return sorted(want | {s for s in range(world) if not got[s]})

        self.runner.wait(cl, poll, "combine/rows", peers, lambda: dc_detail(batch))
        cl.record(j, "reduce", a)

    def _combine_ubep(self, cl: CombineCall, j: int) -> None:
        if j == 0:
            self._c_hello(cl, j)
        self._c_send(cl, j, True)
        self._c_reduce(cl, j, need_all_hellos=True)

    def _combine_bsp(self, cl: CombineCall, j: int) -> None:
        ctx = self.ctx
        self._c_send(cl, j, False)                      # Token-Sending
        self.runner.barrier(cl, 1, "combine")
        if j == 0:                                      # flags after the barrier
            if ctx.fmt.sync in ("sw", "dc"):
                for tj in range(cl.n):
                    KS.write_batch_flags(ctx.bases, ctx.lay, 1, ctx.rank, cl.epoch, tj,
                                         cl.cs[tj], ctx.dc_corrupt)
            self._c_hello(cl, 0)
            a = now_us()                                # Flag verification
            hello = np.full((ctx.world, 3), -1, np.int64)
            got = np.zeros(ctx.world, np.int8)
            self.runner.wait(cl, lambda s: KS.poll_hello(ctx.base, ctx.lay, cl.epoch, hello,
                                                         got, s),
                             "combine/flags", lambda: [s for s in range(ctx.world) if not got[s]])
            check_peers_meta(hello, cl.elem, ctx.rank, "combine")
            cl.record(0, "wait_flags", a, "wait")
        self.runner.barrier(cl, 2, "combine")
        self._c_reduce(cl, j, need_all_hellos=False)    # Reduce
