"""`ShmBackend`: dispatch and combine between processes of one host through shared memory.

Ranks are processes; each maps every rank's region (`region.py`). A rank's `workers` are
threads (`workers.py`) running Numba kernels (`kernels.py`). Two execution models:

* mode "ubep" (kernel decomposition): count workers send per-expert counts first, wait for
  every source's counts, compute offsets and publish them (release store); token workers
  send their rows, then reorder each received row as soon as the offsets are published and
  the row is seen complete. No barrier. With one worker the same order runs in one thread.
* mode "bsp" (the baseline): Token-Sending -> barrier -> Send-Flag-and-Count -> Flag
  verification -> barrier -> CalCumSum -> barrier -> Token-Reordering.

Combine writes each expert-output row back to its source's window at (token, slot); the
source sums a token as soon as all its slots arrived (ubep) or after the phases (bsp).
Every wait is bounded (`timeout_s`) and checks peer liveness; failures raise
`PeerTimeoutError` / `PeerDiedError` / `ShmProtocolError` (all `UbepError`).
"""

from __future__ import annotations

import functools
import os
import socket
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from ubep.errors import PeerDiedError, PeerTimeoutError, UbepError
from ubep.handle import (
    CombineResult,
    DispatchHandle,
    DispatchResult,
    new_combine_result,
    new_dispatch_result,
    new_handle,
)
from ubep.options import BufferConfig
from ubep.plan.blocks import BlockFormat, sentinel_refusal
from ubep.runtime.shm import direct_kernels as DK
from ubep.runtime.shm import kernels as K
from ubep.runtime.shm import segments
from ubep.runtime.shm.direct import DirectPath
from ubep.runtime.shm.region import (
    D_END,
    L_BB,
    L_EL,
    L_SIZE,
    META_BYTES,
    STATUS_ABORT,
    STATUS_OK,
    direct_layout,
    region_layout,
)
from ubep.runtime.shm.workers import WorkerPool
from ubep.stats import DeferredStats, Interval, Stats
from ubep.validate import MOVABLE_DTYPES

#: kernel spin rounds before a poll returns "not ready" to the Python backoff
SPINS = 64
#: how long a waiter yields the core between polls before it starts sleeping, seconds: on an
#: idle host the peer is running and answers within microseconds; when threads outnumber
#: cores, sched_yield hands the core to whoever is runnable
YIELD_S = 200e-6
#: how often a waiting worker checks that its peers are alive, seconds
LIVENESS_EVERY_S = 0.005


class ShmProtocolError(UbepError):
    """Peers disagree about a call (dtype), or a peer aborted it (bad input on that rank)."""


class _Cancelled(Exception):
    """Another worker of this rank failed; stop waiting."""


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


def default_workers(local_ranks: int) -> int:
    """Cores available to this process divided among the ranks of the host, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


_DTYPE_CODES = {d: i for i, d in enumerate(MOVABLE_DTYPES)}


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPE_CODES[dtype]


_LUTS: dict[torch.dtype, np.ndarray] = {}


def _combine_elem(dtype: torch.dtype) -> tuple[int, np.ndarray]:
    """(element code, fp32 lookup table) for summing rows of `dtype` in `reduce_tokens`."""
    if dtype == torch.float32:
        return K.ELEM_F32, np.zeros(1, np.float32)
    if dtype == torch.bfloat16:
        return K.ELEM_BF16, np.zeros(1, np.float32)
    lut = _LUTS.get(dtype)
    if lut is None:
        if dtype.itemsize == 2:
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
        else:
            bits = torch.arange(256, dtype=torch.int16).to(torch.uint8)
        lut = _LUTS[dtype] = bits.view(dtype).to(torch.float32).numpy().copy()
    return (K.ELEM_LUT16 if dtype.itemsize == 2 else K.ELEM_LUT8), lut


def _cast_rows(y: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sums `y` as a tensor of `dtype`, single-threaded (see `K.f32_to_bf16`)."""
    if dtype == torch.float32:
        return torch.from_numpy(y)
    if dtype == torch.bfloat16:
        bits = np.empty(y.shape, np.uint16)
        K.f32_to_bf16(y, bits)
        return torch.from_numpy(bits).view(torch.bfloat16)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):                # > 65504 -> inf, as torch does
            return torch.from_numpy(y.astype(np.float16))   # round to nearest even
    return torch.from_numpy(y).to(dtype)                # fp8: rare, small


class _Resources:
    """What must be released: segments, their views, the worker pool. Owns no backend ref."""

    def __init__(self):
        self.own: segments.Segment | None = None
        self.own_name: str | None = None
        self.own_unlinked = False
        self.peers: list = []
        self.views: list = []
        self.pool: WorkerPool | None = None
        self.peer_names: list[str] = []
        self.peer_pids: list[int] = []

    def release(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.own_name is not None and not self.own_unlinked:
            segments.unlink_name(self.own_name)
            self.own_unlinked = True
        for name, pid in zip(self.peer_names, self.peer_pids):  # what dead peers left
            if pid != os.getpid() and not segments.pid_alive(pid):
                segments.unlink_name(name)
        self.views.clear()
        for shm in [*self.peers, self.own]:
            if shm is not None:
                try:
                    shm.close()
                except (BufferError, OSError):
                    pass
        self.peers, self.own = [], None


class _Call:
    """State shared by the workers of one call."""

    __slots__ = ("epoch", "deadline", "error", "n", "iv", "barrier_base", "data")

    def __init__(self, epoch: int, deadline: float, n: int, barrier_base: int):
        self.epoch = epoch
        self.deadline = deadline
        self.error: BaseException | None = None
        self.n = n
        self.iv: list[list[tuple]] = [[] for _ in range(n)]
        self.barrier_base = barrier_base
        self.data: dict = {}


class ShmBackend:
    """Dispatch/combine through shared memory between the ranks of one host."""

    def __init__(self, config: BufferConfig, group, buffer_id: int):
        c = config
        self.config = c
        self.group = group
        self.buffer_id = buffer_id
        self.rank, self.world = c.rank, c.world_size
        self.fmt = BlockFormat(c.sync, c.block_bytes)
        self.workers = c.workers or default_workers(c.world_size)
        self._closed = False
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        try:
            self._bootstrap(group)
        except BaseException:
            self._finalizer()
            raise
        self._d_epoch = 0
        self._c_epoch = 0
        self._local = np.zeros(16, np.int64)       # barrier counter, publish word
        self._local_addr = self._local.ctypes.data
        self._barrier_count = 0
        self._dc_corrupt = 0                       # tests: add this to dc checksums
        self._setup_plans()
        w, el = self.world, c.experts_per_rank     # scratch of the one-worker path
        self._cs = np.zeros(w, np.int64)
        self._rc = np.zeros((w, el), np.int64)
        self._meta = np.zeros((w, 3), np.int64)
        self._got = np.zeros(w, np.int8)
        self._batch = np.zeros(w, np.int64)
        self._out_start = np.zeros((w, el), np.int64)
        self._hello = np.zeros((w, 3), np.int64)
        self._bsp = c.mode == "bsp"
        self._direct = DirectPath(self, self.dlay, self._res.views[self.rank]) \
            if c.direct else None

    # -- bootstrap ---------------------------------------------------------------------------
    def _bootstrap(self, group) -> None:
        c, res = self.config, self._res
        mine = (socket.gethostname(), os.getpid(), self.workers,
                os.environ.get("UBEP_JOB_ID", ""), c.direct)
        infos: list = [None] * self.world
        dist.all_gather_object(infos, mine, group=group)
        hosts = sorted({i[0] for i in infos})
        if len({bool(i[4]) for i in infos}) > 1:
            raise ValueError("direct= differs between ranks: every rank of the group must "
                             "create its Buffer with the same direct= option")
        if len(hosts) > 1:
            raise ValueError(
                f"backend='shm' needs every rank on one host, but the group spans {hosts}; "
                f"use backend='torch' across hosts")
        self.pids = [int(i[1]) for i in infos]
        res.peer_pids = self.pids
        self.max_workers = max(int(i[2]) for i in infos)
        job = infos[0][3] or f"{self.pids[0]}"
        self.lay = region_layout(   # direct: the windows are not used, keep them minimal
            world=self.world, experts_per_rank=c.experts_per_rank, max_workers=self.max_workers,
            hidden=1 if c.direct else c.hidden, max_tokens=1 if c.direct else
            c.max_tokens_per_rank, max_top_k=c.max_top_k, fmt=self.fmt)
        self.dlay = direct_layout(
            start=int(self.lay[L_SIZE]), world=self.world, num_experts=c.num_experts,
            hidden=c.hidden, max_tokens=c.max_tokens_per_rank, max_top_k=c.max_top_k) \
            if c.direct else None
        size = int(self.dlay[D_END]) if c.direct else int(self.lay[L_SIZE])
        segments.sweep_stale()
        name = segments.segment_name(job, self.buffer_id, self.rank)
        res.own = segments.create(name, size)
        res.own_name = name
        names: list = [None] * self.world
        dist.all_gather_object(names, name, group=group)
        res.peer_names = list(names)
        bases = np.zeros(self.world, np.int64)
        for r, n in enumerate(names):
            shm = res.own if r == self.rank else segments.attach(n)
            if r != self.rank:
                res.peers.append(shm)
            view = np.frombuffer(shm.buf, np.uint8)
            if view.size < size:
                raise RuntimeError(f"segment {n} of rank {r} is smaller than the layout")
            res.views.append(view)
            bases[r] = view.ctypes.data
        self.bases = bases
        self.base = int(bases[self.rank])
        if self.fmt.sync == "sp":
            K.arm_sentinels(self.base, self.lay)
        K.warm_up(lambda: region_layout(world=1, experts_per_rank=c.experts_per_rank,
                                        max_workers=1, hidden=2, max_tokens=1, max_top_k=1,
                                        fmt=self.fmt), self.workers > 1)
        if c.direct:
            DK.warm_up()
        ok: list = [None] * self.world
        dist.all_gather_object(ok, True, group=group)   # everyone mapped (and armed)
        segments.unlink_name(name)                       # memory lives while mapped
        res.own_unlinked = True
        if self.workers > 1:
            res.pool = WorkerPool(self.workers, name=f"ubep-r{self.rank}-b{self.buffer_id}")

    def _setup_plans(self) -> None:
        from ubep.plan import Topology, make_plan

        c = self.config
        self._make_plan = make_plan
        self.topology = Topology.resolve(c.topology, self.world)
        one = torch.zeros(1, 1, dtype=torch.int64)
        self._expert_order = np.ascontiguousarray(make_plan(
            one, topology=self.topology, rank=self.rank, num_experts=c.num_experts, workers=1,
            schedule=c.schedule, mode=c.mode).expert_order, dtype=np.int64)
        self._static = c.schedule == "static"

    # -- helpers -----------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what} after close")

    def _plan(self, idx_np: np.ndarray, topk_idx: torch.Tensor):
        """(token workers, count workers, per-token-worker sends and window positions,
        send_counts, count_dest_ranges) from the Plan of this call."""
        c = self.config
        n = self.workers
        if n == 1:
            sends, pos, counts = K.plan_single(idx_np, self._expert_order, self._static,
                                               c.experts_per_rank)
            return 1, 0, [sends], [pos], counts, [(0, self.world)]
        p = self._make_plan(topk_idx, topology=self.topology, rank=self.rank,
                            num_experts=c.num_experts, workers=n, count_workers=c.count_workers,
                            schedule=c.schedule, mode=c.mode)
        ws = [np.ascontiguousarray(s) for s in p.worker_sends]
        wp = [np.ascontiguousarray(s) for s in p.worker_window_pos]
        return (p.token_workers, p.count_workers, ws, wp, np.ascontiguousarray(p.send_counts),
                p.count_dest_ranges)

    def _wait(self, call: _Call | None, poll, phase: str, peers_of, detail_of=None,
              deadline: float | None = None) -> None:
        """Re-enter `poll(spins)` until it returns 0, backing off; deadline and liveness.

        Spins in the kernel first, then yields the core (for `YIELD_S`), then sleeps
        20-100 us per round: with more busy threads than cores, backing off is what lets the
        peer progress.
        """
        if poll(SPINS) == 0:
            return
        if deadline is None:
            deadline = call.deadline
        n = 0
        now = time.monotonic()
        yield_until = now + YIELD_S
        next_live = now + LIVENESS_EVERY_S
        while True:
            if call is not None and call.error is not None:
                raise _Cancelled()
            if now < yield_until:
                os.sched_yield()                               # let a runnable peer go first
            else:
                n += 1
                time.sleep(min(100e-6, 20e-6 * n))             # then short sleeps
            if poll(SPINS) == 0:
                return
            now = time.monotonic()
            if now >= next_live:
                next_live = now + LIVENESS_EVERY_S
                dead = [r for r, pid in enumerate(self.pids)
                        if r != self.rank and not segments.pid_alive(pid)]
                if dead:
                    raise PeerDiedError(self.rank, phase, dead)
            if now > deadline:
                if poll(SPINS) == 0:
                    return
                raise PeerTimeoutError(self.rank, phase, peers_of(), self.config.timeout_s,
                                       detail_of() if detail_of else "")

    def _barrier(self, call: _Call, k: int, phase: str) -> None:
        """The k-th barrier (1-based) among this call's n workers."""
        if call.n == 1:
            return
        addr = self._local_addr
        K.barrier_arrive(addr)
        target = call.barrier_base + k * call.n
        self._wait(call, lambda s: 0 if K.poll_at_least(addr, target, s) else 1,
                   f"{phase}/barrier", lambda: [self.rank])

    def _run(self, call: _Call, fn) -> None:
        def on_error(e: BaseException) -> None:
            if call.error is None and not isinstance(e, _Cancelled):
                call.error = e

        if call.n == 1:
            fn(0)
            return
        try:
            self._res.pool.run(fn, call.n, on_error)
        except BaseException:
            if call.error is not None:
                raise call.error from None
            raise
        finally:
            if call.error is not None:
                self._barrier_count = -1   # barrier counter out of step: the Buffer is broken

    def _start(self, epoch: int, n: int) -> _Call:
        if self._barrier_count < 0:
            raise UbepError("an earlier call failed; this backend cannot be reused")
        call = _Call(epoch, time.monotonic() + self.config.timeout_s, n,
                     int(self._local[0]))
        return call

    def _stats(self, op: str, call: _Call, t0: float, t1: float, record_bytes: int,
               sent: int, recv: int, extra: dict) -> Stats:
        intervals = []
        phases: dict[str, list[float]] = {}
        for j, ivs in enumerate(call.iv):
            for name, a, b, kind in ivs:
                intervals.append(Interval(self.rank, j, name, a, b, kind))
                p = phases.get(name)
                if p is None:
                    phases[name] = [a, b]
                else:
                    p[0], p[1] = min(p[0], a), max(p[1], b)
        c = self.config
        wire = self.fmt.wire_bytes(record_bytes)
        return Stats(op=op, backend="shm", mode=c.mode, sync=c.sync, schedule=c.schedule,
                     rank=self.rank, total_us=t1 - t0,
                     phases_us={k: v[1] - v[0] for k, v in phases.items()},
                     intervals=intervals, bytes_sent=sent * wire, bytes_recv=recv * wire,
                     payload_efficiency=self.fmt.efficiency(record_bytes), extra=extra)

    def _check_peers_meta(self, meta: np.ndarray, elem: int, what: str) -> None:
        aborted = [s for s in range(self.world) if meta[s, 2] == STATUS_ABORT]
        if aborted:
            raise ShmProtocolError(f"rank {self.rank}: peer rank(s) {aborted} aborted the "
                                   f"{what} (bad input on that rank, see its error)")
        wrong = [s for s in range(self.world) if meta[s, 1] != elem]
        if wrong:
            names = {s: str(MOVABLE_DTYPES[int(meta[s, 1])]) for s in wrong}
            raise ShmProtocolError(
                f"rank {self.rank} {what}s {MOVABLE_DTYPES[elem]} rows but rank(s) {names} "
                f"use another dtype; every rank must pass the same dtype")

    # -- dispatch ----------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        self._check_open("dispatch")
        t0 = _now_us()
        if self._direct is not None:
            return self._direct.dispatch(x, topk_idx, topk_weights, call, t0)
        c = self.config
        if c.sync == "sp":
            why = sentinel_refusal(str(x.dtype))
            if why:
                raise ValueError(why)
        if self.workers == 1:
            return self._dispatch_single(x, topk_idx, topk_weights, call, t0)
        idx = topk_idx.numpy()
        w = topk_weights.numpy()
        num_tokens, top_k = idx.shape
        xb = x.view(torch.uint8).reshape(num_tokens, -1).numpy() if x.numel() else \
            np.zeros((num_tokens, x.shape[1] * x.element_size()), np.uint8)
        elem = _dtype_code(x.dtype)
        n_tw, n_count, w_sends, w_pos, counts, dest_ranges = self._plan(idx, topk_idx)
        self._d_epoch += 1
        epoch = self._d_epoch
        n = self.workers if c.mode == "bsp" or n_count else 1
        cl = self._start(epoch, n)
        t_plan = _now_us()
        cl.iv[0].append(("plan", t0, t_plan, "busy"))
        if c.sync == "sp":
            for sends in w_sends:
                bad = K.sp_check_dispatch(xb, w, sends, int(self.lay[L_BB]))
                if bad >= 0:
                    K.send_counts(self.bases, self.lay, self.rank, epoch, counts, n_tw, elem,
                                  STATUS_ABORT, 0, self.world)
                    t = int(sends[bad, 0])
                    raise ValueError(
                        f"x row {t} holds the sp sentinel pattern 0xFFF7FFF7FFF7FFF7 at a "
                        f"block marker position; sync='sp' cannot send it (the receiver would "
                        f"wait forever): use sync='tff'")
        el = c.experts_per_rank
        d = cl.data
        d.update(xb=xb, idx=idx, w=w, elem=elem, n_tw=n_tw, n_count=n_count, sends=w_sends,
                 pos=w_pos, counts=counts, dest_ranges=dest_ranges,
                 rc=np.zeros((self.world, el), np.int64),
                 meta=np.full((self.world, 3), -1, np.int64),
                 got=np.zeros(self.world, np.int8),
                 cs=[np.zeros(self.world, np.int64) for _ in range(max(n_tw, 1))],
                 batch=np.zeros(self.world, np.int64), rb=xb.shape[1], dtype=x.dtype,
                 hidden=x.shape[1])
        if c.mode == "bsp":
            self._run(cl, lambda j: self._dispatch_bsp(cl, j))
        else:
            self._run(cl, lambda j: self._dispatch_ubep(cl, j))
        t1 = _now_us()
        out = d["out"]
        n_recv = int(d["n_recv"])
        handle = DispatchHandle(
            buffer_id=self.buffer_id, call=call, num_tokens=num_tokens, num_recv=n_recv,
            hidden=x.shape[1], topk_idx=topk_idx, topk_weights=topk_weights,
            recv_src_rank=out["rank"], recv_src_token=out["tok"], recv_src_slot=out["slot"],
            state=(idx, w, out["np"], epoch))
        extra = {"epoch": epoch, "workers": n, "token_workers": n_tw, "count_workers": n_count,
                 "block_bytes": c.block_bytes}
        stats = self._stats("dispatch", cl, t0, t1, META_BYTES + d["rb"],
                            sum(len(s) for s in w_sends), n_recv, extra)
        return DispatchResult(
            recv_x=out["x"], recv_weights=out["w"], tokens_per_expert=out["tpe"],
            recv_src_rank=out["rank"], recv_src_token=out["tok"], recv_src_slot=out["slot"],
            handle=handle, stats=stats)

    def _d_send_counts(self, cl: _Call, j: int, lo: int, hi: int) -> None:
        d = cl.data
        a = _now_us()
        K.send_counts(self.bases, self.lay, self.rank, cl.epoch, d["counts"], d["n_tw"],
                      d["elem"], STATUS_OK, lo, hi)
        cl.iv[j].append(("send_counts", a, _now_us(), "busy"))

    def _d_send_rows(self, cl: _Call, j: int, tj: int, flags: bool) -> None:
        d = cl.data
        a = _now_us()
        cs = d["cs"][tj]
        K.send_rows(self.bases, self.lay, self.rank, cl.epoch, d["xb"], d["idx"], d["w"],
                    d["sends"][tj], d["pos"][tj], d["counts"], cs)
        if flags and self.fmt.sync in ("sw", "dc"):
            K.write_batch_flags(self.bases, self.lay, 0, self.rank, cl.epoch, tj, cs,
                                self._dc_corrupt)
        cl.iv[j].append(("send_rows", a, _now_us(), "busy"))

    def _d_poll_counts(self, cl: _Call, j: int, lo: int, hi: int) -> None:
        d = cl.data
        a = _now_us()
        rc, meta, got = d["rc"], d["meta"], d["got"]
        self._wait(cl, lambda s: K.poll_counts(self.base, self.lay, cl.epoch, lo, hi, rc, meta,
                                               got, s),
                   "dispatch/counts", lambda: [s for s in range(lo, hi) if not got[s]])
        cl.iv[j].append(("wait_counts", a, _now_us(), "wait"))

    def _d_offsets(self, cl: _Call, j: int) -> None:
        """CalCumSum: offsets of every (source, expert) run; allocate the outputs."""
        d = cl.data
        a = _now_us()
        self._check_peers_meta(d["meta"], d["elem"], "dispatch")
        el = self.config.experts_per_rank
        out_start = np.empty((self.world, el), np.int64)
        tpe = np.empty(el, np.int64)
        n_recv = K.offsets(d["rc"], out_start, tpe)
        recv_x = torch.empty((n_recv, d["hidden"]), dtype=d["dtype"])
        ints = np.empty((3, n_recv), np.int64)
        wts = np.empty(n_recv, np.float32)
        xnp = recv_x.view(torch.uint8).reshape(n_recv, d["rb"]).numpy() if n_recv and d["rb"] \
            else np.zeros((n_recv, d["rb"]), np.uint8)
        d["n_recv"] = n_recv
        d["out_start"] = out_start
        d["done"] = np.zeros(n_recv, np.uint8)
        d["out"] = {"x": recv_x, "w": torch.from_numpy(wts), "tpe": torch.from_numpy(tpe),
                    "rank": torch.from_numpy(ints[0]), "tok": torch.from_numpy(ints[1]),
                    "slot": torch.from_numpy(ints[2]), "np": ints, "xnp": xnp, "wnp": wts}
        cl.iv[j].append(("offsets", a, _now_us(), "busy"))

    def _d_recv(self, cl: _Call, j: int, part: int, parts: int) -> None:
        d = cl.data
        a = _now_us()
        n_recv = d["n_recv"]
        lo, hi = part * n_recv // parts, (part + 1) * n_recv // parts
        if hi > lo:
            o = d["out"]
            ints = o["np"]
            rc, meta, out_start, done = d["rc"], d["meta"], d["out_start"], d["done"]
            batch = d["batch"] if parts == 1 else np.zeros(self.world, np.int64)
            self._wait(
                cl, lambda s: K.recv_rows(self.base, self.lay, cl.epoch, rc, meta, out_start,
                                          lo, hi, done, batch, o["xnp"], o["wnp"], ints[0],
                                          ints[1], ints[2], s),
                "dispatch/rows", lambda: self._missing_sources(rc, done, lo, hi),
                lambda: ("dc checksum mismatch from rank(s) "
                         f"{[s for s in range(self.world) if batch[s] == -1]}"
                         if (batch == -1).any() else ""))
        cl.iv[j].append(("reorder", a, _now_us(), "busy"))

    def _missing_sources(self, rc: np.ndarray, done: np.ndarray, lo: int, hi: int) -> list[int]:
        ends = np.cumsum(rc.sum(1))
        starts = ends - rc.sum(1)
        return [s for s in range(self.world)
                if max(starts[s], lo) < min(ends[s], hi)
                and not done[max(starts[s], lo):min(ends[s], hi)].all()]

    def _wait_published(self, cl: _Call, j: int) -> None:
        a = _now_us()
        addr = self._local_addr + 8
        self._wait(cl, lambda s: 0 if K.poll_at_least(addr, cl.epoch, s) else 1,
                   "dispatch/offsets", lambda: [self.rank])
        cl.iv[j].append(("wait_offsets", a, _now_us(), "wait"))

    def _dispatch_ubep(self, cl: _Call, j: int) -> None:
        d = cl.data
        n_count = d["n_count"]
        if n_count == 0:                       # one thread, dependency order
            self._d_send_counts(cl, 0, 0, self.world)
            self._d_send_rows(cl, 0, 0, True)
            self._d_poll_counts(cl, 0, 0, self.world)
            self._d_offsets(cl, 0)
            self._d_recv(cl, 0, 0, 1)
        elif j < n_count:                      # count role
            lo, hi = d["dest_ranges"][j]
            self._d_send_counts(cl, j, lo, hi)
            if j == 0:
                self._d_poll_counts(cl, j, 0, self.world)
                self._d_offsets(cl, j)
                K.publish(self._local_addr + 8, cl.epoch)
        else:                                  # token role
            tj = j - n_count
            self._d_send_rows(cl, j, tj, True)
            self._wait_published(cl, j)
            self._d_recv(cl, j, tj, d["n_tw"])

    def _dispatch_bsp(self, cl: _Call, j: int) -> None:
        d = cl.data
        n = cl.n
        self._d_send_rows(cl, j, j, False)                  # Token-Sending
        self._barrier(cl, 1, "dispatch")
        if j == 0:                                          # Send-Flag-and-Count
            a = _now_us()
            if self.fmt.sync in ("sw", "dc"):
                for tj in range(d["n_tw"]):
                    K.write_batch_flags(self.bases, self.lay, 0, self.rank, cl.epoch, tj,
                                        d["cs"][tj], self._dc_corrupt)
            cl.iv[0].append(("send_flags", a, _now_us(), "busy"))
            self._d_send_counts(cl, 0, 0, self.world)
        lo, hi = j * self.world // n, (j + 1) * self.world // n   # Flag verification
        if hi > lo:
            self._d_poll_counts(cl, j, lo, hi)
        self._barrier(cl, 2, "dispatch")
        if j == 0:
            self._d_offsets(cl, 0)                          # CalCumSum
        self._barrier(cl, 3, "dispatch")
        self._d_recv(cl, j, j, n)                           # Token-Reordering

    # -- combine -----------------------------------------------------------------------------
    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool) -> CombineResult:
        self._check_open("combine")
        t0 = _now_us()
        if self._direct is not None:
            return self._direct.combine(expert_out, handle, weighted, t0)
        c = self.config
        dtype = expert_out.dtype
        if c.sync == "sp":
            why = sentinel_refusal(str(dtype))
            if why:
                raise ValueError(why)
        if self.workers == 1:
            return self._combine_single(expert_out, handle, weighted, t0)
        idx, w, ints, _ = handle.state
        n_recv = handle.num_recv
        hidden = handle.hidden
        rows = expert_out.view(torch.uint8).reshape(n_recv, -1).numpy() if expert_out.numel() \
            else np.zeros((n_recv, hidden * expert_out.element_size()), np.uint8)
        elem = _dtype_code(dtype)
        self._c_epoch += 1
        epoch = self._c_epoch
        n = self.workers
        cl = self._start(epoch, n)
        if c.sync == "sp":
            bad = K.sp_check_rows(rows, int(self.lay[L_BB]))
            if bad >= 0:
                K.send_hello(self.bases, self.lay, self.rank, epoch, n, elem, STATUS_ABORT)
                raise ValueError(
                    f"expert_out row {bad} holds the sp sentinel pattern 0xFFF7FFF7FFF7FFF7 at "
                    f"a block marker position; sync='sp' cannot send it: use sync='tff'")
        ecode, lut = _combine_elem(dtype)
        num_tokens = idx.shape[0]
        d = cl.data
        d.update(rows=rows, ints=ints, idx=idx, w=w, elem=elem, ecode=ecode, lut=lut,
                 weighted=bool(weighted), es=expert_out.element_size(),
                 y=np.zeros((num_tokens, hidden), np.float32),
                 done=np.zeros(num_tokens, np.uint8),
                 cs=[np.zeros(self.world, np.int64) for _ in range(n)])
        if c.mode == "bsp":
            self._run(cl, lambda j: self._combine_bsp(cl, j))
        else:
            self._run(cl, lambda j: self._combine_ubep(cl, j))
        y = _cast_rows(d["y"], dtype)
        t1 = _now_us()
        stats = self._stats("combine", cl, t0, t1, rows.shape[1], n_recv,
                            int((idx >= 0).sum()), {"epoch": epoch, "workers": n})
        return CombineResult(y=y, stats=stats)

    def _c_send(self, cl: _Call, j: int, flags: bool) -> None:
        d = cl.data
        a = _now_us()
        n_recv = d["rows"].shape[0]
        lo, hi = j * n_recv // cl.n, (j + 1) * n_recv // cl.n
        ints, cs = d["ints"], d["cs"][j]
        K.send_back(self.bases, self.lay, cl.epoch, d["rows"], ints[0], ints[1], ints[2], lo, hi,
                    cs)
        if flags and self.fmt.sync in ("sw", "dc"):
            K.write_batch_flags(self.bases, self.lay, 1, self.rank, cl.epoch, j, cs,
                                self._dc_corrupt)
        cl.iv[j].append(("send_rows", a, _now_us(), "busy"))

    def _c_hello(self, cl: _Call, j: int) -> None:
        a = _now_us()
        K.send_hello(self.bases, self.lay, self.rank, cl.epoch, cl.n, cl.data["elem"],
                     STATUS_OK)
        cl.iv[j].append(("send_flags", a, _now_us(), "busy"))

    def _c_reduce(self, cl: _Call, j: int, need_all_hellos: bool) -> None:
        """Sum my tokens' rows as they arrive; also collect every peer's hello."""
        d = cl.data
        a = _now_us()
        num_tokens = d["idx"].shape[0]
        tlo, thi = j * num_tokens // cl.n, (j + 1) * num_tokens // cl.n
        hello = np.full((self.world, 3), -1, np.int64)
        got = np.zeros(self.world, np.int8)
        batch = np.zeros(self.world, np.int64)
        state = {"checked": False}

        def poll(s: int) -> int:
            missing = K.poll_hello(self.base, self.lay, cl.epoch, hello, got, 1)
            if missing == 0 and not state["checked"]:
                self._check_peers_meta(hello, d["elem"], "combine")
                state["checked"] = True
            rem = K.reduce_tokens(self.base, self.lay, cl.epoch, d["idx"], d["w"],
                                  d["weighted"], d["rows"].shape[1], d["es"], d["ecode"],
                                  d["lut"], hello, tlo, thi, d["done"], batch, d["y"], s)
            return rem + (missing if need_all_hellos else 0)

        def peers() -> list[int]:
            el = self.lay[L_EL]
            idx, done = d["idx"], d["done"]
            want = {int(e) // int(el) for t in range(tlo, thi) if not done[t]
                    for e in idx[t] if e >= 0}
            if self.fmt.sync in ("sw", "dc"):   # batch-granular: the ranks not complete
                want = {r for r in want if batch[r] != 1}
            return sorted(want | {s for s in range(self.world) if not got[s]})

        self._wait(cl, poll, "combine/rows", peers,
                   lambda: ("dc checksum mismatch from rank(s) "
                            f"{[s for s in range(self.world) if batch[s] == -1]}"
                            if (batch == -1).any() else ""))
        cl.iv[j].append(("reduce", a, _now_us(), "busy"))

    def _combine_ubep(self, cl: _Call, j: int) -> None:
        if j == 0:
            self._c_hello(cl, j)
        self._c_send(cl, j, True)
        self._c_reduce(cl, j, need_all_hellos=True)

    def _combine_bsp(self, cl: _Call, j: int) -> None:
        d = cl.data
        self._c_send(cl, j, False)                      # Token-Sending
        self._barrier(cl, 1, "combine")
        if j == 0:                                      # flags after the barrier
            if self.fmt.sync in ("sw", "dc"):
                for tj in range(cl.n):
                    K.write_batch_flags(self.bases, self.lay, 1, self.rank, cl.epoch, tj,
                                        d["cs"][tj], self._dc_corrupt)
            self._c_hello(cl, 0)
        if j == 0:                                      # Flag verification
            a = _now_us()
            hello = np.full((self.world, 3), -1, np.int64)
            got = np.zeros(self.world, np.int8)
            self._wait(cl, lambda s: K.poll_hello(self.base, self.lay, cl.epoch, hello, got, s),
                       "combine/flags", lambda: [s for s in range(self.world) if not got[s]])
            self._check_peers_meta(hello, d["elem"], "combine")
            cl.iv[0].append(("wait_flags", a, _now_us(), "wait"))
        self._barrier(cl, 2, "combine")
        self._c_reduce(cl, j, need_all_hellos=False)    # Reduce

    # -- one worker: the same dependency order in the calling thread, lean --------------------
    def _sentinel_error(self, what: str, row: int) -> ValueError:
        return ValueError(
            f"{what} row {row} holds the sp sentinel pattern 0xFFF7FFF7FFF7FFF7 at a block "
            f"marker position; sync='sp' cannot send it (the receiver would wait forever): "
            f"use sync='tff'")

    def _single_scratch(self) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """(kernel results `res`, fp32 sums `[max_tokens * hidden]`, their address, a
        writable copy of the expert order), made on first use and kept: the one-worker path
        allocates nothing it can reuse. (The plan's expert order may be read-only; the kernels
        were warmed up for writable arrays, and Numba compiles per array flag.)"""
        sc = getattr(self, "_single", None)
        if sc is None:
            c = self.config
            y = np.zeros(c.max_tokens_per_rank * c.hidden, np.float32)
            sc = self._single = (np.zeros(4, np.int64), y, y.ctypes.data,
                                 np.array(self._expert_order, np.int64))
        return sc

    @staticmethod
    def _single_dispatch_stats(c: BufferConfig, fmt: BlockFormat, r: int,
                               ts: tuple[float, ...], n_sends: int, n_recv: int, rb: int,
                               epoch: int) -> Stats:
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

    @staticmethod
    def _single_combine_stats(c: BufferConfig, fmt: BlockFormat, r: int,
                              ts: tuple[float, ...], n_sent: int, n_recv: int, rb: int,
                              epoch: int) -> Stats:
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

    @staticmethod
    @functools.cache
    def _single_combine_elem(dtype: torch.dtype) -> tuple[int, int, np.ndarray]:
        """(dtype code, element code, fp32 lookup table) of combine rows, once per dtype."""
        return (_DTYPE_CODES[dtype], *_combine_elem(dtype))

    def _dispatch_single(self, x: torch.Tensor, topk_idx: torch.Tensor,
                         topk_weights: torch.Tensor, call: int, t0: float) -> DispatchResult:
        """One worker, in the calling thread: send and a first look at the counts in one
        kernel entry, then the outputs, then the rows. Tensors reach the kernels by address
        (`data_ptr()`); the handle keeps them alive. Stats, row origins and weights become
        objects when first read."""
        c = self.config
        res, _, _, order = self._single_scratch()
        num_tokens, hidden = x.shape
        top_k = topk_idx.shape[1]
        rb = hidden * x.element_size()
        elem = _DTYPE_CODES[x.dtype]
        idx_addr, w_addr = topk_idx.data_ptr(), topk_weights.data_ptr()
        self._d_epoch = epoch = self._d_epoch + 1
        deadline = time.monotonic() + c.timeout_s
        rc, meta, got, out_start, batch = (self._rc, self._meta, self._got, self._out_start,
                                           self._batch)
        base, lay = self.base, self.lay
        tpe = np.empty(c.experts_per_rank, np.int64)
        missing = K.dispatch_begin_at(self.bases, lay, self.rank, epoch, x.data_ptr(),
                                      num_tokens, rb, idx_addr, top_k, w_addr, order,
                                      self._static, elem, self._dc_corrupt, self._cs, self._bsp,
                                      rc, meta, got, out_start, tpe, batch, res)
        if missing:
            t1 = _now_us()
            self._wait(None, lambda s: K.dispatch_counts_at(base, lay, epoch, rc, meta, got,
                                                            out_start, tpe, batch, elem, res, s),
                       "dispatch/counts", lambda: [s for s in range(self.world) if not got[s]],
                       deadline=deadline)
            t2 = _now_us()
        else:
            t1 = t2 = _now_us()
        n_sends, code, n_recv, _ = res.tolist()
        if n_sends < 0:
            raise self._sentinel_error("x", -n_sends - 1)
        if code:
            self._check_peers_meta(meta, elem, "dispatch")
        recv_x = torch.empty(n_recv, hidden, dtype=x.dtype)
        ints = np.empty((3, n_recv), np.int64)
        wts = np.empty(n_recv, np.float32)
        done = np.zeros(n_recv, np.uint8)
        x_addr = recv_x.data_ptr()
        self._wait(None, lambda s: K.recv_rows_at(base, lay, epoch, rc, meta, out_start, n_recv,
                                                  done, batch, x_addr, rb, wts, ints, s),
                   "dispatch/rows", lambda: self._missing_sources(rc, done, 0, n_recv),
                   lambda: self._dc_detail(batch), deadline=deadline)
        t3 = _now_us()
        handle = new_handle(self.buffer_id, call, num_tokens, n_recv, hidden, topk_idx,
                            topk_weights, ints, (idx_addr, w_addr, top_k, ints))
        stats = DeferredStats.of(self._single_dispatch_stats, c, self.fmt, self.rank,
                                 (t0, t1, t2, t3), n_sends, n_recv, rb, epoch)
        return new_dispatch_result(recv_x, wts, torch.from_numpy(tpe), handle, stats)

    def _dc_detail(self, batch: np.ndarray) -> str:
        bad = [s for s in range(self.world) if batch[s] == -1]
        return f"dc checksum mismatch from rank(s) {bad}" if bad else ""

    def _combine_missing(self, handle: DispatchHandle, done: np.ndarray) -> list[int]:
        """The ranks a one-worker combine still waits for (rows of unfinished tokens, hellos)."""
        el = int(self.lay[L_EL])
        idx, batch, got = handle.topk_idx.numpy(), self._batch, self._got
        want = {int(e) // el for t in range(handle.num_tokens) if not done[t]
                for e in idx[t] if e >= 0}
        if self.fmt.sync in ("sw", "dc"):
            want = {r for r in want if batch[r] != 1}
        return sorted(want | {s for s in range(self.world) if not got[s]})

    def _combine_single(self, expert_out: torch.Tensor, handle: DispatchHandle, weighted: bool,
                        t0: float) -> CombineResult:
        """One worker: rows back in one kernel entry, then sum (and round to bf16) in the
        poll. fp32 sums land in the output itself, bf16 ones in kept scratch; by address."""
        c = self.config
        dtype = expert_out.dtype
        idx_addr, w_addr, top_k, ints = handle.state
        num_tokens, hidden, n_recv = handle.num_tokens, handle.hidden, handle.num_recv
        res, y_scratch, y_addr, _ = self._single_scratch()
        elem, ecode, lut = self._single_combine_elem(dtype)
        es = expert_out.element_size()
        rb = hidden * es
        self._c_epoch = epoch = self._c_epoch + 1
        deadline = time.monotonic() + c.timeout_s
        hello, got, batch, base, lay = self._hello, self._got, self._batch, self.base, self.lay
        out = None
        if dtype is torch.float32:                     # sum in place, no cast
            out = torch.empty(num_tokens, hidden, dtype=dtype)
            y_addr = out.data_ptr()
        bad = K.combine_begin_at(self.bases, lay, self.rank, epoch, expert_out.data_ptr(), n_recv,
                                 rb, ints, elem, self._dc_corrupt, self._cs, self._bsp, hello,
                                 got, batch, y_addr, num_tokens, hidden)
        if bad < 0:
            raise self._sentinel_error("expert_out", -bad - 1)
        t1 = _now_us()
        cast, out_addr = K.CAST_NONE, 0
        if dtype is torch.bfloat16:                   # the poll rounds into it once complete
            out = torch.empty(num_tokens, hidden, dtype=dtype)
            cast, out_addr = K.CAST_BF16, out.data_ptr()
        done = np.zeros(num_tokens, np.uint8)
        bsp, weighted = self._bsp, bool(weighted)
        self._wait(None, lambda s: K.combine_poll_at(base, lay, epoch, idx_addr, w_addr,
                                                     num_tokens, top_k, weighted, rb, es, ecode,
                                                     lut, hello, got, done, batch, y_addr,
                                                     hidden, s, bsp, elem, cast, out_addr, res),
                   "combine/rows", lambda: self._combine_missing(handle, done),
                   lambda: self._dc_detail(batch), deadline=deadline)
        _, code, _, routed = res.tolist()
        if code:
            self._check_peers_meta(hello, elem, "combine")
        if out is None:                                # fp16, fp8: rare, cast by torch/numpy
            out = _cast_rows(y_scratch[:num_tokens * hidden].reshape(num_tokens, hidden), dtype)
        t2 = _now_us()
        stats = DeferredStats.of(self._single_combine_stats, c, self.fmt, self.rank, (t0, t1, t2),
                                 n_recv, routed, rb, epoch)
        return new_combine_result(out, stats)

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """direct=True: the `[N, hidden]` view combine reads in place (see DirectPath)."""
        self._check_open("get_combine_buffer")
        return self._direct.combine_buffer(handle, dtype)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop workers, unmap and release every segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
