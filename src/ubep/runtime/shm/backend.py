"""`ShmBackend`: dispatch and combine between processes of one host through shared memory.

Ranks are processes; each maps every rank's region (`region.py`, `segments.py`). The
backend bootstraps (every rank creates its region, maps its peers', compiles the kernels)
and hands each call to one of three paths, chosen once per Buffer:

* `single.SinglePath`: one worker per rank, the call in the calling thread;
* `pool.PoolPath`: `workers` >= 2 threads in the paper's roles (mode "ubep") or in the
  baseline's barrier-separated phases (mode "bsp");
* `direct.DirectPath`: `direct=True`, rows copied once, straight to their final place.

Every wait is bounded (`timeout_s`) and checks peer liveness (`waits.py`); failures raise
`PeerTimeoutError` / `PeerDiedError` / `ShmProtocolError` (all `UbepError`).
"""

from __future__ import annotations

import os
import socket
import weakref

import numpy as np
import torch
import torch.distributed as dist

from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.options import BufferConfig
from ubep.plan import Topology, WorkerMapper
from ubep.plan.blocks import BlockFormat, sentinel_refusal
from ubep.runtime.shm import segments
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.direct import DirectPath
from ubep.runtime.shm.kernels.sentinel import arm_sentinels
from ubep.runtime.shm.kernels.warmup import warm_up, warm_up_direct
from ubep.runtime.shm.pool import PoolPath
from ubep.runtime.shm.protocol import ShmProtocolError
from ubep.runtime.shm.region import D_END, L_SIZE, direct_layout, region_layout
from ubep.runtime.shm.single import SinglePath
from ubep.runtime.shm.waits import now_us
from ubep.runtime.shm.workers import WorkerPool

__all__ = ["ShmBackend", "ShmProtocolError", "default_workers"]


def default_workers(local_ranks: int) -> int:
    """Cores available to this process divided among the ranks of the host, at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_ranks))


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
            self.ctx = self._bootstrap(group)
        except BaseException:
            self._finalizer()
            raise
        self._refuse_sp = c.sync == "sp" and not c.direct
        self.topology = Topology.resolve(c.topology, self.world)
        mapper = WorkerMapper.of(self.topology, self.rank, c.num_experts, c.schedule)
        if c.direct:
            self._path = DirectPath(self.ctx)
        elif self.workers == 1:
            self._path = SinglePath(self.ctx, mapper)
        else:
            self._path = PoolPath(self.ctx, mapper,
                                  WorkerMapper.of(self.topology, self.rank, self.world,
                                                  c.schedule))

    # -- bootstrap ---------------------------------------------------------------------------
    def _bootstrap(self, group) -> ShmContext:
        """Create my region, map every peer's, compile the kernels; all ranks in step."""
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
        pids = [int(i[1]) for i in infos]
        self.pids = res.peer_pids = pids
        max_workers = max(int(i[2]) for i in infos)
        job = infos[0][3] or f"{pids[0]}"
        lay = region_layout(   # direct: the windows are not used, keep them minimal
            world=self.world, experts_per_rank=c.experts_per_rank, max_workers=max_workers,
            hidden=1 if c.direct else c.hidden, max_tokens=1 if c.direct else
            c.max_tokens_per_rank, max_top_k=c.max_top_k, fmt=self.fmt)
        dlay = direct_layout(
            start=int(lay[L_SIZE]), world=self.world, num_experts=c.num_experts,
            hidden=c.hidden, max_tokens=c.max_tokens_per_rank, max_top_k=c.max_top_k) \
            if c.direct else None
        size = int(dlay[D_END]) if c.direct else int(lay[L_SIZE])
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
        base = int(bases[self.rank])
        if self.fmt.sync == "sp":
            arm_sentinels(base, lay)
        warm_up(lambda: region_layout(world=1, experts_per_rank=c.experts_per_rank,
                                      max_workers=1, hidden=2, max_tokens=1, max_top_k=1,
                                      fmt=self.fmt), self.workers > 1)
        if c.direct:
            warm_up_direct()
        ok: list = [None] * self.world
        dist.all_gather_object(ok, True, group=group)   # everyone mapped (and armed)
        segments.unlink_name(name)                       # memory lives while mapped
        res.own_unlinked = True
        if self.workers > 1:
            res.pool = WorkerPool(self.workers, name=f"ubep-r{self.rank}-b{self.buffer_id}")
        return ShmContext(config=c, buffer_id=self.buffer_id, rank=self.rank, world=self.world,
                          fmt=self.fmt, workers=self.workers, pids=pids, bases=bases,
                          base=base, lay=lay, dlay=dlay, region=res.views[self.rank],
                          pool=res.pool)

    # -- calls -------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what} after close")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        self._check_open("dispatch")
        t0 = now_us()
        if self._refuse_sp:
            why = sentinel_refusal(str(x.dtype))
            if why:
                raise ValueError(why)
        return self._path.dispatch(x, topk_idx, topk_weights, call, t0)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool) -> CombineResult:
        self._check_open("combine")
        t0 = now_us()
        if self._refuse_sp:
            why = sentinel_refusal(str(expert_out.dtype))
            if why:
                raise ValueError(why)
        return self._path.combine(expert_out, handle, weighted, t0)

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """direct=True: the `[N, hidden]` view combine reads in place (see DirectPath)."""
        self._check_open("get_combine_buffer")
        return self._path.combine_buffer(handle, dtype)

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop workers, unmap and release every segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
