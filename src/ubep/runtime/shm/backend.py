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

from ubep import tuning
from ubep.elastic import Membership, expand, note_combine, without_sources
from ubep.handle import CombineResult, DispatchHandle, DispatchResult
from ubep.native import load_native
from ubep.options import BufferConfig
from ubep.plan import Topology, WorkerMapper
from ubep.plan.blocks import BlockFormat, sentinel_refusal
from ubep.runtime import Backend, bootstrap
from ubep.runtime.shm import segments
from ubep.runtime.shm.context import ShmContext
from ubep.runtime.shm.direct.native import DirectNativePath
from ubep.runtime.shm.direct.path import DirectPath
from ubep.runtime.shm.direct.pool import DirectPoolPath
from ubep.runtime.shm.kernels.sentinel import arm_sentinels
from ubep.runtime.shm.kernels.warmup import warm_up, warm_up_direct, warm_up_elastic
from ubep.runtime.shm.membership import ShmMembership
from ubep.runtime.shm.pool.path import PoolPath
from ubep.runtime.shm.protocol import SentinelAbort, ShmProtocolError
from ubep.runtime.shm.region import MAX_ELASTIC_RANKS, region_layout, segment_layouts
from ubep.runtime.shm.staged.path import SinglePath
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

    def release(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.own_name is not None and not self.own_unlinked:
            segments.unlink_name(self.own_name)
            self.own_unlinked = True
        for shm in self.peers:          # what dead peers left (a name is never reused)
            if not shm.owner_alive():
                segments.unlink_name(shm.name)
        self.views.clear()
        for shm in [*self.peers, self.own]:
            if shm is not None:
                try:
                    shm.close()
                except (BufferError, OSError):
                    pass
        self.peers, self.own = [], None


def _raise_if_any_failed(names: list, size: int, world: int) -> None:
    """The same error on every rank if any rank could not create its segment."""
    failed = {r: f for r, (_, f) in enumerate(names) if f is not None}
    if not failed:
        return
    if all(f[0] == "ShmCapacityError" for f in failed.values()):
        free = min(f[2] for f in failed.values())
        raise segments.ShmCapacityError(
            f"rank(s) {sorted(failed)} could not reserve shared memory: this Buffer needs "
            f"{size} bytes per rank, {world * size} bytes in {segments.SHM_DIR} for {world} "
            f"ranks, and {free} bytes were free. Make {segments.SHM_DIR} larger (docker: "
            f"--shm-size) or lower max_tokens_per_rank, hidden or max_top_k",
            needed=world * size, available=free)
    detail = "; ".join(f"rank {r}: {f[1]}" for r, f in sorted(failed.items()))
    raise segments.ShmError(f"rank(s) {sorted(failed)} could not create their shared-memory "
                            f"segment: {detail}")


class ShmBackend(Backend):
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
        #: False once a call failed after its peers were told (see `Buffer._failed`)
        self.in_step = True
        if c.elastic:
            if self.world > MAX_ELASTIC_RANKS:
                raise ValueError(f"elastic=True on the shm backend supports up to "
                                 f"{MAX_ELASTIC_RANKS} ranks (one bit each in a shared word), "
                                 f"got a group of {self.world}")
            if c.sync == "sp":
                raise ValueError("elastic=True does not apply to sync='sp': sp re-arms each "
                                 "block as it reads it, so a combine cannot sum a token again "
                                 "without the rows of a rank that died mid-call; use 'tff' "
                                 "(the default), 'sw' or 'dc'")
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _Resources.release, self._res)
        try:
            self.ctx = self._bootstrap(group)
        except BaseException:
            self._finalizer()
            raise
        #: the elastic membership (`Buffer(elastic=True)`), else None
        self.membership = None
        if c.elastic:
            self.membership = Membership(self.rank, self.world, c.experts_per_rank)
            self.ctx.members = ShmMembership(self.membership, self.ctx.region, self.ctx.bases,
                                             self.ctx.segs)
            # read before every call (`Buffer`): the shared word and the bits applied
            self.membership_word = (self.ctx.members.word, self.ctx.members.applied)
        self._refuse_sp = c.sync == "sp" and not c.direct
        self.topology = Topology.resolve(c.topology, self.world)
        mapper = WorkerMapper.of(self.topology, self.rank, c.num_experts, c.schedule)
        if c.direct:
            native = load_native() if self.workers == 1 else None
            self._path = (DirectPoolPath(self.ctx) if self.workers > 1
                          else DirectPath(self.ctx) if native is None
                          else DirectNativePath(self.ctx, native))
        elif self.workers == 1:
            self._path = SinglePath(self.ctx, mapper)
        else:
            self._path = PoolPath(self.ctx, mapper,
                                  WorkerMapper.of(self.topology, self.rank, self.world,
                                                  c.schedule),
                                  tuning.choices(self.topology.name, self.workers,
                                                 c.num_experts))

    # -- bootstrap ---------------------------------------------------------------------------
    def _bootstrap(self, group) -> ShmContext:
        """Create my region, map every peer's, compile the kernels; all ranks in step.

        Every exchange waits at most `timeout_s`; a rank that cannot reserve its region makes
        every rank raise the same `ShmCapacityError` before any data moves.
        """
        c, res = self.config, self._res

        def exchange(obj, phase: str) -> list:
            return bootstrap.exchange(obj, group, rank=self.rank, world=self.world,
                                      timeout_s=c.timeout_s, phase=f"Buffer()/{phase}")

        # compile first: local work, outside the window in which our names exist
        warm_up(lambda: region_layout(world=1, experts_per_rank=c.experts_per_rank,
                                      max_workers=1, hidden=2, max_tokens=1, max_top_k=1,
                                      fmt=self.fmt), self.workers > 1)
        if c.direct:
            warm_up_direct()
        if c.elastic:
            warm_up_elastic(lambda: region_layout(world=1, experts_per_rank=c.experts_per_rank,
                                                  max_workers=1, hidden=2, max_tokens=1,
                                                  max_top_k=1, fmt=self.fmt))
        infos = exchange((socket.gethostname(), self.workers,
                          os.environ.get("UBEP_JOB_ID", ""), segments.host_memory_key()),
                         "hosts")
        # one shared memory (boot id, /dev/shm mount), not one hostname: containers sharing
        # the host's IPC namespace have hostnames of their own
        if None in {i[3] for i in infos} or len({i[3] for i in infos}) > 1:
            hosts = sorted({i[0] for i in infos})
            raise ValueError(
                f"backend='shm' needs every rank on one host, mapping the same /dev/shm, but "
                f"the group's ranks (on {hosts}) do not share one; use backend='torch' "
                f"across hosts")
        max_workers = max(int(i[1]) for i in infos)
        job = infos[0][2] or "job"
        lay, dlay, size = segment_layouts(c, max_workers=max_workers, fmt=self.fmt)
        segments.sweep_stale()
        name = segments.segment_name(job, self.buffer_id, self.rank)
        failure = None
        try:
            res.own = segments.create(name, size)      # memory reserved: no SIGBUS later
            res.own_name = name
        except segments.ShmError as e:
            failure = (type(e).__name__, str(e), getattr(e, "available", 0))
        names = exchange((name, failure), "segments")
        _raise_if_any_failed(names, size, self.world)
        bases = np.zeros(self.world, np.int64)
        segs = []
        for r, (n, _) in enumerate(names):
            shm = res.own if r == self.rank else segments.attach(n)
            if r != self.rank:
                res.peers.append(shm)
            segs.append(shm)
            view = np.frombuffer(shm.buf, np.uint8)
            if view.size < size:
                raise RuntimeError(f"segment {n} of rank {r} is smaller than the layout")
            res.views.append(view)
            bases[r] = view.ctypes.data
        base = int(bases[self.rank])
        if self.fmt.sync == "sp":
            arm_sentinels(base, lay)
        exchange(True, "attach")                          # everyone mapped (and armed)
        segments.unlink_name(name)                        # memory lives while mapped
        res.own_unlinked = True
        if self.workers > 1:
            res.pool = WorkerPool(self.workers, name=f"ubep-r{self.rank}-b{self.buffer_id}")
        return ShmContext(config=c, buffer_id=self.buffer_id, rank=self.rank, world=self.world,
                          fmt=self.fmt, workers=self.workers, segs=segs, bases=bases,
                          base=base, lay=lay, dlay=dlay, region=res.views[self.rank],
                          pool=res.pool)

    # -- calls -------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"cannot {what} after close")

    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 call: int) -> DispatchResult:
        """Run a path's dispatch; `in_step` False after an error raised once peers were
        involved (`Buffer` then refuses further use even for a ValueError, e.g. the sp
        sentinel's)."""
        if self._closed:
            self._check_open("dispatch")
        t0 = now_us()
        if self._refuse_sp:
            why = sentinel_refusal(str(x.dtype))
            if why:
                raise ValueError(why)
        try:
            res = self._path.dispatch(x, topk_idx, topk_weights, call, t0)
        except SentinelAbort:
            self.in_step = False
            raise
        if self.membership is not None and "_dropped" in res.__dict__:
            res = without_sources(res, res.__dict__["_dropped"])
        return res

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                weighted: bool, out: torch.Tensor | None = None) -> CombineResult:
        """Run a path's combine (`in_step` as in `dispatch`)."""
        if self._closed:
            self._check_open("combine")
        t0 = now_us()
        if self._refuse_sp:
            why = sentinel_refusal(str(expert_out.dtype))
            if why:
                raise ValueError(why)
        if self.membership is None:
            try:
                return self._path.combine(expert_out, handle, weighted, t0, out)
            except SentinelAbort:
                self.in_step = False
                raise
        return self._elastic_combine(expert_out, handle, weighted, t0, out)

    def _elastic_combine(self, expert_out: torch.Tensor, handle: DispatchHandle,
                         weighted: bool, t0: float, out: torch.Tensor | None) -> CombineResult:
        """`combine` of an elastic Buffer: a handle whose dispatch dropped a dead source's
        rows combines through its full layout (`ubep.elastic.expand`); slots on ranks
        inactive now are not summed (the routing without them); `handle.masked` then says
        which slots were not summed (those, and those of ranks dropped meanwhile)."""
        m = self.membership
        noted = handle
        if "_full" in handle.__dict__:
            expert_out, handle = expand(expert_out, handle)
        before = m.inactive
        if before:
            idx, hit = m.mask(handle.topk_idx)
            if hit is not None:
                handle = self._path.with_routing(handle, idx)
        res = self._path.combine(expert_out, handle, weighted, t0, out)
        note_combine(noted, m, before + self._path.dropped)
        return res

    # -- elastic ------------------------------------------------------------------------------
    #: elastic: (my region's membership word, the bits of it applied so far), which `Buffer`
    #: compares before every call (ranks another rank found inactive); None without
    membership_word = None

    def sync_membership(self) -> None:
        """Read the shared word into `membership` (`RankRemovedError` if this rank is out)."""
        self.ctx.members.sync()

    def set_active_ranks(self, mask: np.ndarray) -> None:
        """Remove the ranks `mask` (`[world]` bool) drops, after the remaining ranks agreed on
        it (`ShmMembership.agree_drain`); both epochs jump by two, so a removed rank that
        still calls matches nothing of theirs."""
        ctx = self.ctx
        deadline = ctx.deadline()
        ctx.members.agree_drain(mask, ctx.config.timeout_s,
                                lambda poll, phase, peers: ctx.wait(poll, phase, peers,
                                                                    deadline=deadline))
        self._path.skip_epochs(2)

    @property
    def DOOR_ENTRIES(self) -> tuple[str, str]:    # noqa: N802 - the torch backend's constant
        """`ubep_native`'s entries for `door`'s tuple (`Buffer` calls them): the path's."""
        return self._path.DOOR_ENTRIES

    def door(self, lock, limits: tuple[int, int, int, int],
             buffer_words: np.ndarray) -> tuple | None:
        """The path's words for `ubep.native`'s door (`DirectPath.door`, `SinglePath.door`),
        its calls that must wait going on in `resume`; None: the pool path has none, and
        only a path whose calls this layer adds nothing to."""
        door = getattr(self._path, "door", None)
        return (None if door is None or self._refuse_sp
                else door(lock, limits, buffer_words, self.resume))

    def resume(self, which: str, *args) -> DispatchResult | CombineResult:
        """A door's call that must wait: `DirectPath.dispatch_resume` or `combine_resume`
        (`which`), `in_step` kept as `dispatch` and `combine` keep it. (Elastic: the door
        runs only while every rank is active; a rank found dead in this wait is dropped as
        in `dispatch` and `combine`.)"""
        try:
            res = getattr(self._path, which)(*args)
        except SentinelAbort:
            self.in_step = False
            raise
        if self.membership is not None:
            if "_dropped" in res.__dict__:
                res = without_sources(res, res.__dict__["_dropped"])
            elif which == "combine_resume" and self._path.dropped:
                handle = args[2]
                note_combine(handle, self.membership, self._path.dropped)
        return res

    def combine_buffer(self, handle: DispatchHandle, dtype: torch.dtype | None) -> torch.Tensor:
        """direct=True: the `[N, hidden]` view combine reads in place (see DirectPath)."""
        self._check_open("get_combine_buffer")
        return self._path.combine_buffer(handle, dtype)

    # -- lifecycle ---------------------------------------------------------------------------
    def leave(self) -> None:
        """Make the peers find this rank gone (its liveness lock released) without unmapping
        anything: their waits on it fail within a liveness probe. For a caller that abandons
        the exchange on purpose (the elastic hybrid backend's recovery); no call may follow."""
        if self._res.own is not None:
            self._res.own.unlock()

    def close(self) -> None:
        """Stop workers, unmap and release every segment, drop kept output memory
        (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        release = getattr(self._path, "release_outputs", None)
        if release is not None:
            release()
