"""The worker-pool path: a rank's call run by `workers` >= 2 threads, in roles or phases.

mode "ubep" (kernel decomposition, docs/design.md §2.1), no barrier, no central plan:

* count worker i counts its share of the routing (the experts of its destination ranks),
  sends those ranks their counts, then receives its share of the sources' counts; once the
  count group has them all (one in-rank flag per count worker), it runs CalCumSum for its
  share of the local experts and publishes it (another flag); count worker 0 also makes
  the outputs;
* token worker j computes its own slice of the sends with the planner's mapper
  (`WorkerMapper`: per-hop counts -> quaternary search -> its (token, slot) pairs), sends
  at once, then waits for the count group's flags and reorders its share of the received
  rows as each is seen complete.

Combine has the same roles: count workers send the hellos (dtype, token workers, status)
to their share of the ranks; token worker j sends back its slice of the rows, scheduled
by the same mapper over the rows' source ranks (far ranks spread evenly); then every worker
sums its share of the tokens as their rows arrive.

mode "bsp" (the baseline): Token-Sending -> barrier -> Send-Flag-and-Count -> Flag
verification -> barrier -> CalCumSum -> barrier -> Token-Reordering; combine: rows ->
barrier -> flags -> verification -> barrier -> reduce. Each worker maps its own slice too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ubep.handle import CombineResult, DispatchHandle, DispatchResult, rerouted
from ubep.plan import WorkerMapper
from ubep.plan.costmodel import balance_count_workers
from ubep.plan.fastplan import count_expert_range, worker_sends
from ubep.runtime.shm.call import Call, CallRunner
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.elements import cast_rows, combine_elem
from ubep.runtime.shm.inactive import (
    drop_partial,
    mark_dropped,
    proxy_counts,
    proxy_hellos,
    tokens_on,
)
from ubep.runtime.shm.kernels import combine as KC
from ubep.runtime.shm.kernels import dispatch as KD
from ubep.runtime.shm.kernels import sentinel as KP
from ubep.runtime.shm.kernels import slots as KS
from ubep.runtime.shm.outputs import OutputPool
from ubep.runtime.shm.protocol import (
    DTYPE_CODES,
    check_peers_meta,
    dc_detail,
    sentinel_error,
)
from ubep.runtime.shm.region import (
    L_BB,
    L_EL,
    META_BYTES,
    STATUS_ABORT,
    STATUS_OK,
    next_epoch,
)
from ubep.runtime.shm.staged.path import missing_sources
from ubep.runtime.shm.waits import now_us
from ubep.stats import Interval, Stats

_NO_16 = np.zeros((0, 0), np.uint16)        # reduce_tokens_into: "do not round here"
#: combine dtypes whose sums land in the output tensor itself (fp32) or are rounded into it
_IN_PLACE = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(eq=False, kw_only=True)
class DispatchCall(Call):
    """One dispatch on the pool: its inputs, the roles, and what the workers fill in."""

    xb: np.ndarray                  # [T, row bytes] uint8, the rows to send
    idx: np.ndarray                 # [T, K] int64 topk_idx
    w: np.ndarray                   # [T, K] float32 topk_weights
    dtype: torch.dtype
    hidden: int
    elem: int                       # dtype code (`protocol.DTYPE_CODES`)
    n_tw: int                       # token workers (mode "bsp": every worker)
    n_count: int                    # count workers (mode "bsp": 0)
    dest_ranges: list[tuple[int, int]]   # per count worker: destination ranks it counts for
    src_ranges: list[tuple[int, int]]    # per count worker: sources whose counts it reads
    expert_ranges: list[tuple[int, int]]  # per count worker: local experts it sums
    counts: np.ndarray              # [E] my sends per expert (count workers, each a share)
    rc: np.ndarray                  # [world, E/P] counts received from each source
    meta: np.ndarray                # [world, 3] each source's (token workers, dtype, status)
    got: np.ndarray                 # [world] int8: source's counts read
    cs: list[np.ndarray]            # per token worker: [world] dc checksum terms
    batch: np.ndarray               # [world] sw/dc batch state (see `recv_rows`)
    n_sent: list[int]               # per token worker: sends
    out_start: np.ndarray           # [world, E/P] output row of each (source, expert)
    tpe: np.ndarray                 # [E/P] tokens per local expert
    # set by count worker 0 (mode "bsp": worker 0) once it knows N (`_outputs`):
    n_recv: int = 0
    done: np.ndarray | None = None       # [n_recv] uint8: row reordered
    recv_x: torch.Tensor | None = None
    recv_xb: np.ndarray | None = None    # recv_x as [n_recv, row bytes] uint8
    recv_w: np.ndarray | None = None     # [n_recv] float32
    ints: np.ndarray | None = None       # [3, n_recv] (source rank, token, slot)
    #: elastic: inactive sources whose rows were dropped (`inactive.drop_partial`)
    dropped: list[int] = field(default_factory=list)

    @property
    def rb(self) -> int:
        return self.xb.shape[1]


def _shares(total: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of `parts` contiguous shares of `total` items (sizes differ by at most 1)."""
    return [(i * total // parts, (i + 1) * total // parts) for i in range(parts)]


@dataclass(eq=False, kw_only=True)
class CombineCall(Call):
    """One combine on the pool: rows to send back, the routing, and the sums."""

    rows: np.ndarray                # [N, row bytes] uint8 expert outputs
    ints: np.ndarray                # [3, N] (source rank, token, slot) of each row
    idx: np.ndarray                 # [T, K] int64 my routing
    w: np.ndarray                   # [T, K] float32
    elem: int                       # dtype code
    ecode: int                      # element code (`kernels.combine.ELEM_*`)
    lut: np.ndarray                 # fp32 lookup table of ecode LUT8 (fp8)
    weighted: bool
    es: int                         # element size, bytes
    y: np.ndarray                   # [T, hidden] float32 sums
    out16: np.ndarray               # [T, hidden] bf16/fp16 bits the sums are rounded into, or
                                    # no rows (the sums stay in `y`)
    done: np.ndarray                # [T] uint8: token summed
    n_tw: int                       # workers that send rows back (batch flags per rank)
    n_count: int                    # workers that send the hellos (mode "ubep")
    cs: list[np.ndarray] = field(default_factory=list)  # per worker: [world] dc checksums
    #: every rank's hello, once a worker has them all (elastic: for `_sum_again`)
    hello: np.ndarray | None = None
    routing: torch.Tensor | None = None  # elastic: `idx` as a tensor (`_drop_sources`)


class PoolPath:
    """Dispatch and combine of a rank with `workers` >= 2 threads."""

    def __init__(self, ctx: ShmContext, mapper: WorkerMapper, rank_mapper: WorkerMapper,
                 tuned: dict[int, int] | None = None):
        """`mapper` maps this rank's dispatch sends; `rank_mapper` (one "expert" per rank)
        maps combine's rows back by source rank; `tuned`: count-worker choices `ubep tune`
        recorded for this topology, worker and expert count, by batch (`ubep.tuning`)."""
        self.ctx = ctx
        self.runner = CallRunner(ctx)
        self.mapper = mapper
        self.rank_mapper = rank_mapper
        self._d_epoch = 0
        self._c_epoch = 0
        #: elastic: ranks whose rows the latest combine dropped (`inactive.py`)
        self.dropped: list[int] = []
        self._drop_lock = threading.Lock()
        self._n_count: dict[tuple[int, int], int] = {}
        self._tuned = tuned or {}
        self._lend = OutputPool()           # recv_x and combine outputs: no page faults
        c = ctx.config
        self._y = np.zeros(c.max_tokens_per_rank * c.hidden, np.float32)   # fp32 sums, kept

    def release_outputs(self) -> None:
        """Drop the output pool's kept blocks (at close; tensors lent out stay valid)."""
        self._lend.close()

    def _count_workers(self, num_tokens: int, top_k: int) -> int:
        """Workers in the count role: `config.count_workers`, else the cost model's choice
        for this batch (`ubep.plan.costmodel`: the tuned choice for this batch if `ubep tune`
        recorded one, else Eq. 4; remembered per (tokens, top-k))."""
        c = self.ctx.config
        if c.mode == "bsp":
            return 0
        if c.count_workers is not None:
            return min(c.count_workers, self.ctx.workers - 1)
        key = (num_tokens, top_k)
        n = self._n_count.get(key)
        if n is None:
            n = self._n_count[key] = balance_count_workers(
                self.ctx.workers, c.num_experts, top_k, num_tokens, ranks=self.ctx.world,
                tuned=self._tuned.get(num_tokens))
        return n

    def _map(self, idx: np.ndarray, n_tw: int, tj: int) -> tuple[np.ndarray, np.ndarray,
                                                                 np.ndarray]:
        """Token worker tj's own slice: `(counts [E], sends [m, 3], window_pos [m])`."""
        m = self.mapper
        return worker_sends(idx, m.num_experts, m.experts_per_rank, m.hop_of_rank,
                            m.rank_of_expert, m.kind, n_tw, m.num_hop_classes, tj)

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
        world, n, el = ctx.world, ctx.workers, c.experts_per_rank
        idx = topk_idx.numpy()
        w = topk_weights.numpy()
        num_tokens, top_k = idx.shape
        xb = x.view(torch.uint8).reshape(num_tokens, -1).numpy() if x.numel() else \
            np.zeros((num_tokens, x.shape[1] * x.element_size()), np.uint8)
        elem = DTYPE_CODES[x.dtype]
        n_count = self._count_workers(num_tokens, top_k)
        n_tw = n - n_count
        self._d_epoch = epoch = next_epoch(self._d_epoch)
        if c.sync == "sp":                     # before any worker sends: refuse, tell peers
            bad = KP.sp_check_routing(xb, idx, w, int(ctx.lay[L_BB]))
            if bad >= 0:
                KS.send_counts(ctx.bases, ctx.lay, ctx.rank, epoch,
                               np.zeros(c.num_experts, np.int64), n_tw, elem, STATUS_ABORT, 0,
                               world)
                raise sentinel_error("x", bad)
        if ctx.members is not None and ctx.members.members.any_inactive:
            proxy_counts(ctx, epoch, elem)
        cl = self.runner.start(DispatchCall(
            epoch=epoch, deadline=ctx.deadline(), n=n, xb=xb, idx=idx, w=w, dtype=x.dtype,
            hidden=x.shape[1], elem=elem, n_tw=n_tw, n_count=n_count,
            dest_ranges=_shares(world, max(n_count, 1)),
            src_ranges=_shares(world, max(n_count, 1)),
            expert_ranges=_shares(el, max(n_count, 1)),
            counts=np.zeros(c.num_experts, np.int64), rc=np.zeros((world, el), np.int64),
            meta=np.full((world, 3), -1, np.int64), got=np.zeros(world, np.int8),
            cs=[np.zeros(world, np.int64) for _ in range(n_tw)],
            batch=np.zeros(world, np.int64), n_sent=[0] * n_tw,
            out_start=np.empty((world, el), np.int64), tpe=np.empty(el, np.int64)))
        if c.mode == "bsp":
            self.runner.run(cl, lambda j: self._dispatch_bsp(cl, j))
        else:
            self.runner.run(cl, lambda j: self._dispatch_ubep(cl, j))
        t1 = now_us()
        ints = cl.ints
        if cl.dropped:
            mark_dropped(ints, cl.rc, cl.out_start, cl.dropped)
        src_rank, src_tok, src_slot = (torch.from_numpy(ints[0]), torch.from_numpy(ints[1]),
                                       torch.from_numpy(ints[2]))
        handle = DispatchHandle(
            buffer_id=ctx.buffer_id, call=call, num_tokens=num_tokens, num_recv=cl.n_recv,
            hidden=x.shape[1], topk_idx=topk_idx, topk_weights=topk_weights,
            recv_src_rank=src_rank, recv_src_token=src_tok, recv_src_slot=src_slot,
            state=(idx, w, ints, epoch))
        extra = {"epoch": epoch, "workers": n, "token_workers": n_tw, "count_workers": n_count,
                 "block_bytes": c.block_bytes, "barriers": self.runner.barriers}
        stats = self._stats("dispatch", cl, t0, t1, META_BYTES + cl.rb, sum(cl.n_sent),
                            cl.n_recv, extra)
        res = DispatchResult(
            recv_x=cl.recv_x, recv_weights=torch.from_numpy(cl.recv_w),
            tokens_per_expert=torch.from_numpy(cl.tpe), recv_src_rank=src_rank,
            recv_src_token=src_tok, recv_src_slot=src_slot, handle=handle, stats=stats)
        if cl.dropped:
            res.__dict__["_dropped"] = cl.dropped
        return res

    # the roles of mode "ubep"
    def _dispatch_ubep(self, cl: DispatchCall, j: int) -> None:
        if j < cl.n_count:
            self._count_role(cl, j)
        else:
            self._token_role(cl, j, j - cl.n_count)

    def _count_role(self, cl: DispatchCall, i: int) -> None:
        """Count worker i: counts for its destinations, its sources' counts, its share of
        CalCumSum. Flags: `i` = "my sources' counts are in", `n_count + i` = "my offsets"."""
        ctx, runner = self.ctx, self.runner
        el = ctx.config.experts_per_rank
        a = now_us()
        d_lo, d_hi = cl.dest_ranges[i]
        count_expert_range(cl.idx, d_lo * el, d_hi * el, cl.counts)
        KS.send_counts(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.counts, cl.n_tw, cl.elem,
                       STATUS_OK, d_lo, d_hi)
        cl.record(i, "send_counts", a)
        s_lo, s_hi = cl.src_ranges[i]
        self._poll_counts(cl, i, s_lo, s_hi)
        check_peers_meta(cl.meta, cl.elem, ctx.rank, "dispatch", s_lo, s_hi)
        runner.publish(cl, i)
        a = now_us()
        for other in range(cl.n_count):        # the count group's counts, point to point
            if other != i:
                runner.wait_flag(cl, other, "dispatch/counts")
        cl.record(i, "wait_count_group", a, "wait")
        a = now_us()
        e_lo, e_hi = cl.expert_ranges[i]
        n_recv = KD.offsets_range(cl.rc, e_lo, e_hi, cl.out_start, cl.tpe)
        if i == 0:
            self._outputs(cl, n_recv)
        runner.publish(cl, cl.n_count + i)
        cl.record(i, "offsets", a)

    def _token_role(self, cl: DispatchCall, j: int, tj: int) -> None:
        """Token worker tj: its own slice, sent at once; then its share of the reordering."""
        a = now_us()
        counts, sends, pos = self._map(cl.idx, cl.n_tw, tj)
        cl.n_sent[tj] = sends.shape[0]
        cl.record(j, "map", a)
        self._send_rows(cl, j, tj, sends, pos, counts, True)
        a = now_us()
        for i in range(cl.n_count):
            self.runner.wait_flag(cl, cl.n_count + i, "dispatch/offsets")
        cl.record(j, "wait_offsets", a, "wait")
        self._recv(cl, j, tj, cl.n_tw)

    # the phases of mode "bsp"
    def _dispatch_bsp(self, cl: DispatchCall, j: int) -> None:
        ctx, runner = self.ctx, self.runner
        n, world = cl.n, ctx.world
        a = now_us()
        counts, sends, pos = self._map(cl.idx, n, j)
        cl.n_sent[j] = sends.shape[0]
        cl.record(j, "map", a)
        self._send_rows(cl, j, j, sends, pos, counts, False)     # Token-Sending
        runner.barrier(cl, 1, "dispatch")
        if j == 0:                                                # Send-Flag-and-Count
            a = now_us()
            if ctx.fmt.sync in ("sw", "dc"):
                for tj in range(cl.n_tw):
                    KS.write_batch_flags(ctx.bases, ctx.lay, 0, ctx.rank, cl.epoch, tj,
                                         cl.cs[tj])
            KS.send_counts(ctx.bases, ctx.lay, ctx.rank, cl.epoch, counts, cl.n_tw, cl.elem,
                           STATUS_OK, 0, world)
            cl.record(0, "send_flags", a)
        lo, hi = j * world // n, (j + 1) * world // n             # Flag verification
        if hi > lo:
            self._poll_counts(cl, j, lo, hi)
        runner.barrier(cl, 2, "dispatch")
        if j == 0:                                                # CalCumSum
            a = now_us()
            check_peers_meta(cl.meta, cl.elem, ctx.rank, "dispatch")
            self._outputs(cl, KD.offsets(cl.rc, cl.out_start, cl.tpe))
            cl.record(0, "offsets", a)
        runner.barrier(cl, 3, "dispatch")
        self._recv(cl, j, j, n)                                   # Token-Reordering

    # pieces
    def _send_rows(self, cl: DispatchCall, j: int, tj: int, sends: np.ndarray, pos: np.ndarray,
                   counts: np.ndarray, flags: bool) -> None:
        ctx = self.ctx
        a = now_us()
        cs = cl.cs[tj]
        KD.send_rows(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.xb, cl.idx, cl.w, sends, pos,
                     counts, cs)
        if flags and ctx.fmt.sync in ("sw", "dc"):
            KS.write_batch_flags(ctx.bases, ctx.lay, 0, ctx.rank, cl.epoch, tj, cs)
        cl.record(j, "send_rows", a)

    def _poll_counts(self, cl: DispatchCall, j: int, lo: int, hi: int) -> None:
        ctx = self.ctx
        a = now_us()
        rc, meta, got = cl.rc, cl.meta, cl.got
        self.runner.wait(cl, lambda s: KS.poll_counts(ctx.base, ctx.lay, cl.epoch, lo, hi, rc,
                                                      meta, got, s),
                         "dispatch/counts", lambda: [s for s in range(lo, hi) if not got[s]],
                         on_inactive=lambda: proxy_counts(ctx, cl.epoch, cl.elem))
        cl.record(j, "wait_counts", a, "wait")

    def _outputs(self, cl: DispatchCall, n_recv: int) -> None:
        """Allocate what the reordering fills: `n_recv` rows, weights, origins."""
        rb = cl.rb
        cl.n_recv = n_recv
        cl.done = np.zeros(n_recv, np.uint8)
        cl.ints = np.empty((3, n_recv), np.int64)
        cl.recv_w = np.empty(n_recv, np.float32)
        cl.recv_x = self._lend.empty(n_recv, cl.hidden, cl.dtype)
        cl.recv_xb = cl.recv_x.view(torch.uint8).reshape(n_recv, rb).numpy() \
            if n_recv and rb else np.zeros((n_recv, rb), np.uint8)

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
                lambda: dc_detail(batch), on_inactive=lambda: self._drop_partial(cl))
        cl.record(j, "reorder", a)

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                t0: float, out: torch.Tensor | None = None) -> CombineResult:
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
        self._c_epoch = epoch = next_epoch(self._c_epoch)
        n = ctx.workers
        if c.sync == "sp":
            bad = KP.sp_check_rows(rows, int(ctx.lay[L_BB]))
            if bad >= 0:
                KS.send_hello(ctx.bases, ctx.lay, ctx.rank, epoch, n, elem, STATUS_ABORT)
                raise sentinel_error("expert_out", bad)
        self.dropped = []
        if ctx.members is not None and ctx.members.members.any_inactive:
            proxy_hellos(ctx, epoch, elem)
        ecode, lut = combine_elem(dtype)
        num_tokens, top_k = idx.shape
        n_count = self._count_workers(num_tokens, top_k)
        # fp32 sums land in the output itself, bf16 and fp16 ones rounded straight into it;
        # others (fp8) in kept scratch, cast after
        y = self._lend.empty(num_tokens, hidden, dtype) if dtype in _IN_PLACE else None
        sums = y.numpy() if dtype == torch.float32 else \
            self._y[:num_tokens * hidden].reshape(num_tokens, hidden)
        out16 = y.view(torch.int16).numpy().view(np.uint16) \
            if dtype in (torch.bfloat16, torch.float16) else _NO_16
        cl = self.runner.start(CombineCall(
            epoch=epoch, deadline=ctx.deadline(), n=n, rows=rows, ints=ints, idx=idx, w=w,
            elem=elem, ecode=ecode, lut=lut, weighted=bool(weighted),
            es=expert_out.element_size(), y=sums, out16=out16,
            done=np.zeros(num_tokens, np.uint8), n_tw=n - n_count, n_count=n_count,
            cs=[np.zeros(world, np.int64) for _ in range(n)]))
        if c.mode == "bsp":
            self.runner.run(cl, lambda j: self._combine_bsp(cl, j))
        else:
            self.runner.run(cl, lambda j: self._combine_ubep(cl, j))
        if self.dropped:         # no token keeps a row of a rank dropped meanwhile
            self._sum_again(cl, tokens_on(idx, self.dropped, c.experts_per_rank))
        if y is None:                              # fp8: rare, cast by numpy/torch
            y = cast_rows(cl.y, dtype)
        if out is not None:
            y = out.copy_(y)
        t1 = now_us()
        stats = self._stats("combine", cl, t0, t1, rows.shape[1], n_recv,
                            int((idx >= 0).sum()),
                            {"epoch": epoch, "workers": n, "token_workers": cl.n_tw,
                             "count_workers": n_count, "barriers": self.runner.barriers})
        return CombineResult(y=y, stats=stats)

    def _c_send(self, cl: CombineCall, j: int, tj: int, items: np.ndarray | None,
                flags: bool) -> None:
        """Worker j sends back the rows `items` (None: its equal share of the received
        order) as sender tj; sw/dc: then its batch flag."""
        ctx = self.ctx
        a = now_us()
        ints, cs = cl.ints, cl.cs[tj]
        if items is None:
            n_recv = cl.rows.shape[0]
            lo, hi = tj * n_recv // cl.n_tw, (tj + 1) * n_recv // cl.n_tw
            KC.send_back(ctx.bases, ctx.lay, cl.epoch, cl.rows, ints[0], ints[1], ints[2], lo,
                         hi, cs)
        else:
            KC.send_back_list(ctx.bases, ctx.lay, cl.epoch, cl.rows, ints[0], ints[1], ints[2],
                              items, cs)
        if flags and ctx.fmt.sync in ("sw", "dc"):
            KS.write_batch_flags(ctx.bases, ctx.lay, 1, ctx.rank, cl.epoch, tj, cs)
        cl.record(j, "send_rows", a)

    def _c_hello(self, cl: CombineCall, j: int, lo: int, hi: int) -> None:
        ctx = self.ctx
        a = now_us()
        KS.send_hellos(ctx.bases, ctx.lay, ctx.rank, cl.epoch, cl.n_tw, cl.elem, STATUS_OK, lo,
                       hi)
        cl.record(j, "send_flags", a)

    def _c_map(self, cl: CombineCall, j: int, tj: int) -> np.ndarray:
        """Token worker tj's rows to send back: the mapper over the rows' source ranks."""
        a = now_us()
        m = self.rank_mapper
        _, sends, _ = worker_sends(cl.ints[0].reshape(-1, 1), m.num_experts, 1, m.hop_of_rank,
                                   m.rank_of_expert, m.kind, cl.n_tw, m.num_hop_classes, tj)
        cl.record(j, "map", a)
        return np.ascontiguousarray(sends[:, 0])

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
                cl.hello = hello
            rem = KC.reduce_tokens_into(ctx.base, ctx.lay, cl.epoch, cl.idx, cl.w, cl.weighted,
                                        cl.rows.shape[1], cl.es, cl.ecode, cl.lut, hello, tlo,
                                        thi, cl.done, batch, cl.y, cl.out16, s)
            return rem + (missing if need_all_hellos else 0)

        def peers() -> list[int]:
            el = int(ctx.lay[L_EL])
            idx, done = cl.idx, cl.done
            want = {int(e) // el for t in range(tlo, thi) if not done[t]
                    for e in idx[t] if e >= 0}
            if ctx.fmt.sync in ("sw", "dc"):   # batch-granular: the ranks not complete
                want = {r for r in want if batch[r] != 1}
            return sorted(want | {s for s in range(world) if not got[s]})

        self.runner.wait(cl, poll, "combine/rows", peers, lambda: dc_detail(batch),
                         on_inactive=lambda: self._drop_sources(cl))
        cl.record(j, "reduce", a)

    # -- elastic (`Buffer(elastic=True)`, `inactive.py`) ------------------------------------------
    def _drop_partial(self, cl: DispatchCall) -> None:
        """Dispatch's rows: drop inactive sources whose rows have not all arrived."""
        with self._drop_lock:
            drop_partial(self.ctx, cl.rc, cl.done, cl.dropped)

    def _drop_sources(self, cl: CombineCall) -> None:
        """Combine's rows: hellos for the inactive ranks, and the workers' routing (`cl.idx`)
        without them; `dropped` collects those this combine routed to."""
        with self._drop_lock:
            proxy_hellos(self.ctx, cl.epoch, cl.elem)
            m = self.ctx.members.members
            gone = [r for r in m.inactive if r not in self.dropped]
            if cl.routing is None:
                cl.routing = torch.from_numpy(cl.idx)
            idx, hit = m.mask(cl.routing, gone)
            if hit is not None:
                self.dropped.extend(gone)
                cl.routing, cl.idx = idx, idx.numpy()

    def _sum_again(self, cl: CombineCall, tokens: np.ndarray) -> None:
        """Sum `tokens` again with the routing without the dropped ranks (their other rows
        are still in my window)."""
        ctx = self.ctx
        cl.done[tokens] = 0
        batch = np.zeros(ctx.world, np.int64)
        hello = cl.hello
        self.runner.wait(
            cl, lambda s: KC.reduce_tokens_into(ctx.base, ctx.lay, cl.epoch, cl.idx, cl.w,
                                                cl.weighted, cl.rows.shape[1], cl.es, cl.ecode,
                                                cl.lut, hello, 0, cl.idx.shape[0], cl.done,
                                                batch, cl.y, cl.out16, s),
            "combine/rows", lambda: [])

    def with_routing(self, handle: DispatchHandle, idx: torch.Tensor) -> DispatchHandle:
        """A copy of `handle` whose combine uses routing `idx` (masked)."""
        _, w, ints, epoch = handle.state
        return rerouted(handle, idx, (idx.numpy(), w, ints, epoch))

    def skip_epochs(self, n: int) -> None:
        """`set_active_ranks`: advance both epochs by `n` (even; see `DirectPath`)."""
        self._d_epoch += n
        self._c_epoch += n

    def _combine_ubep(self, cl: CombineCall, j: int) -> None:
        if j < cl.n_count:                    # count role: the hellos to my share of ranks
            lo, hi = _shares(self.ctx.world, cl.n_count)[j]
            self._c_hello(cl, j, lo, hi)
        else:                                 # token role: my slice of the rows back
            tj = j - cl.n_count
            self._c_send(cl, j, tj, self._c_map(cl, j, tj), True)
        self._c_reduce(cl, j, need_all_hellos=True)

    def _combine_bsp(self, cl: CombineCall, j: int) -> None:
        ctx = self.ctx
        self._c_send(cl, j, j, None, False)             # Token-Sending
        self.runner.barrier(cl, 1, "combine")
        if j == 0:                                      # flags after the barrier
            if ctx.fmt.sync in ("sw", "dc"):
                for tj in range(cl.n):
                    KS.write_batch_flags(ctx.bases, ctx.lay, 1, ctx.rank, cl.epoch, tj,
                                         cl.cs[tj])
            self._c_hello(cl, 0, 0, ctx.world)
            a = now_us()                                # Flag verification
            hello = np.full((ctx.world, 3), -1, np.int64)
            got = np.zeros(ctx.world, np.int8)
            self.runner.wait(cl, lambda s: KS.poll_hello(ctx.base, ctx.lay, cl.epoch, hello,
                                                         got, s),
                             "combine/flags", lambda: [s for s in range(ctx.world) if not got[s]],
                             on_inactive=lambda: proxy_hellos(ctx, cl.epoch, cl.elem))
            check_peers_meta(hello, cl.elem, ctx.rank, "combine")
            cl.record(0, "wait_flags", a, "wait")
        self.runner.barrier(cl, 2, "combine")
        self._c_reduce(cl, j, need_all_hellos=False)    # Reduce
