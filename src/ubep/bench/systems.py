"""The systems a benchmark rank times: Buffer backends, the peers and the two bounds.

Each system is set up once per row width (`hidden`), given one batch's inputs with
`prepare`, then timed through argument-free `dispatch()` and `combine()` calls, so the
timed region holds the operation and nothing of the harness. Systems that return rows have
an `expert()` step the harness calls between the two, untimed: the stand-in expert
(`BenchConfig.expert`) that makes combine's input from recv_x. `check` compares the last
dispatch with the oracle's bytes, so no system is timed while it gives wrong answers.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch
import torch.distributed as dist

from ubep.bench.config import AGRS_RAW, BOUND, BUFFER_SYSTEMS, MPI_RAW, RAW, BenchConfig
from ubep.quant import per_token_cast_back
from ubep.reference import ReferenceDispatch
from ubep.runtime.collectives import all_to_all


def page_aligned(nbytes: int) -> np.ndarray:
    """`nbytes` of zeroed uint8 at a page-aligned address, in 4 KiB pages (an anonymous shared
    mapping, the memory the runtime's regions are; numpy would advise huge pages for 4 MiB
    and more). Kept alive by the array.

    The copy bound copies between two of these. glibc copies a few KiB and more with `rep
    movsb` where the CPU advertises fast string moves, and on AMD Zen 3 that instruction runs
    ~8x slower when the destination lies 1-31 bytes past the source modulo 4 KiB (glibc 2.36;
    2.39 avoids it). Two numpy arrays malloc placed back to back sit exactly 16 bytes apart
    modulo 4 KiB, so a bound copied between them would time that slow case, not the fastest
    copy the core has.
    """
    m = mmap.mmap(-1, max(nbytes, 1))
    return np.frombuffer(m, np.uint8)[:nbytes]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def check_dispatch(name: str, got, ref: ReferenceDispatch) -> str | None:
    """None if `got` (a dispatch result) matches the oracle bit for bit, else what differs.

    A result with scales (fp8) is checked against an oracle of its rows' bytes followed by
    their scales' bytes (`runner.oracle_rows`)."""
    scales = getattr(got, "recv_x_scales", None)
    if scales is not None:
        row_bytes = got.recv_x.shape[1] * got.recv_x.element_size()
        want = ref.recv_x
        if not (_same_bytes(got.recv_x.contiguous().view(torch.uint8), want[:, :row_bytes])
                and _same_bytes(scales.contiguous().view(torch.uint8), want[:, row_bytes:])):
            return f"{name}: recv_x or recv_x_scales differs from the oracle"
    elif not _same_bytes(got.recv_x, ref.recv_x):
        return f"{name}: recv_x differs from the oracle"
    for field in ("tokens_per_expert", "recv_src_rank", "recv_src_token"):
        if not torch.equal(getattr(got, field), getattr(ref, field)):
            return f"{name}: {field} differs from the oracle"
    return None


class _StandInExpert:
    """The untimed step between dispatch and combine of a system that returns rows: combine's
    input made from the last dispatch's recv_x as `BenchConfig.expert` says (`_clone`, set
    by each system from its config); fp8 rows with scales are dequantized into the config's
    dtype (`ubep.quant.per_token_cast_back`: it reads every row and writes a new tensor, as
    a clone does)."""

    _res = _y = None
    _dtype = None

    def expert(self) -> None:
        scales = getattr(self._res, "recv_x_scales", None)
        if scales is not None:
            self._y = per_token_cast_back(self._res.recv_x, scales, self._dtype)
        else:
            self._y = self._res.recv_x.clone() if self._clone else self._res.recv_x


class BufferSystem(_StandInExpert):
    """`ubep.Buffer` with one backend and mode ("shm-ubep", "shm-bsp", "torch")."""

    def __init__(self, name: str, cfg: BenchConfig, hidden: int):
        import ubep

        backend, mode, direct = BUFFER_SYSTEMS[name]
        self.name = name
        self.buf = ubep.Buffer(num_experts=cfg.experts, hidden=hidden,
                               max_tokens_per_rank=max(cfg.batches), backend=backend,
                               mode=mode, workers=cfg.workers if backend == "shm" else None,
                               timeout_s=cfg.timeout_s, max_top_k=cfg.top_k, direct=direct)
        self._clone = cfg.expert == "clone"
        self._dtype = cfg.torch_dtype
        self._args = None

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        self._args = (x, topk_idx, topk_weights)

    def dispatch(self) -> None:
        self._res = self.buf.dispatch(*self._args)

    def combine(self) -> None:
        self.buf.combine(self._y, self._res.handle)

    def check(self, ref: ReferenceDispatch) -> str | None:
        return check_dispatch(self.name, self._res, ref)

    def phases(self) -> dict[str, float]:
        """The backend's own account of the last dispatch and combine, µs by phase.

        Keys are `"<op>:<phase>"` plus `"<op>:backend_total"` (the time inside the backend).
        """
        out: dict[str, float] = {}
        for op, st in (("dispatch", self._res.stats), ("combine", self.buf.last_stats)):
            if st is None:
                continue
            out[f"{op}:backend_total"] = st.total_us
            for name, us in st.phases_us.items():
                out[f"{op}:{name}"] = us
        return out

    def close(self) -> None:
        self.buf.close()


class MpiSystem(_StandInExpert):
    """The MPI peer (`ubep.bench.mpi_peer`) on MPI.COMM_WORLD."""

    def __init__(self, name: str, cfg: BenchConfig, hidden: int, comm):
        from ubep.bench.mpi_peer import MpiPeer

        if comm is None:
            raise RuntimeError("not launched under mpiexec (use `ubep bench --peers`)")
        self.name = name
        self.peer = MpiPeer(comm, cfg.experts)
        self._clone = cfg.expert == "clone"
        self._args = None

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        self._args = (x, topk_idx, topk_weights)

    def dispatch(self) -> None:
        self._res = self.peer.dispatch(*self._args)

    def combine(self) -> None:
        self.peer.combine(self._y, self._res)

    def check(self, ref: ReferenceDispatch) -> str | None:
        return check_dispatch(self.name, self._res, ref)

    def close(self) -> None:
        pass


class MpiCollectives:
    """The MPI peer's collectives alone, on the bytes its last dispatch moved: `dispatch()`
    its `Alltoall` of per-expert counts and its two concurrent `Ialltoallv` (rows; their
    12-byte token, slot, weight), `combine()` its `Alltoallv` of the rows back; on
    preallocated buffers (the send side written), called as the peer calls them. The MPI
    peer's time over this line is what its sorting, reordering and sums cost."""

    def __init__(self, name: str, cfg: BenchConfig, hidden: int, comm):
        from ubep.bench.mpi_peer import MpiPeer

        if comm is None:
            raise RuntimeError("not launched under mpiexec (use `ubep bench --peers`)")
        self.name = name
        self.comm = comm
        self.peer = MpiPeer(comm, cfg.experts)
        self._args: tuple = ()
        self._waitall = None

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        from mpi4py import MPI

        from ubep.bench.mpi_peer import counts_displs

        d = self.peer.dispatch(x, topk_idx, topk_weights)          # its splits, untimed
        rb = x.shape[1] * x.element_size()
        counts = np.ones(self.peer.num_experts, np.int64)

        def vec(rows: np.ndarray, width: int, fill: int):
            n, displs, total = counts_displs(rows, width)     # as the peer computes them
            return [np.full(total, fill, np.uint8), (n, displs), MPI.BYTE]

        s, r = d.send_splits, d.recv_splits
        self._waitall = MPI.Request.Waitall          # not looked up inside the timed call
        self._args = (counts, np.empty_like(counts), (vec(s, rb, 1), vec(r, rb, 0)),
                      (vec(s, 12, 1), vec(r, 12, 0)), (vec(r, rb, 1), vec(s, rb, 0)))

    def dispatch(self) -> None:
        counts, got, rows, meta, _ = self._args
        self.comm.Alltoall(counts, got)
        self._waitall([self.comm.Ialltoallv(*rows), self.comm.Ialltoallv(*meta)])

    def combine(self) -> None:
        self.comm.Alltoallv(*self._args[4])

    def check(self, ref: ReferenceDispatch) -> str | None:
        return None

    def close(self) -> None:
        self._args = ()


class AgRsSystem(MpiSystem):
    """The AgRs peer (`ubep.bench.agrs_peer`) on the default process group."""

    def __init__(self, name: str, cfg: BenchConfig, hidden: int):
        from ubep.bench.agrs_peer import AgRsPeer

        self.name = name
        self.peer = AgRsPeer(cfg.experts)
        self._clone = cfg.expert == "clone"
        self._args = None

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        # every rank has the same batch here; vLLM knows all ranks' sizes before the layer
        self._args = (x, topk_idx, topk_weights, x.shape[0])


class AgRsCollectives:
    """The AgRs peer's two collectives alone, on the bytes it moves: `dispatch()` is its
    all-gather of every rank's packed rows and routing (`[max_tokens, row + 12 K]` bytes a
    rank), `combine()` its reduce-scatter of the `[P * max_tokens, hidden]` partial sums in
    the rows' dtype; preallocated, the send side written, called as the peer calls them.
    The AgRs peer's time over this line is what its layout and sums cost."""

    def __init__(self, name: str, cfg: BenchConfig, hidden: int):
        self.name = name
        self.world = dist.get_world_size()
        self._bufs: tuple = ()

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        t, k = topk_idx.shape
        packed = x.shape[1] * x.element_size() + 12 * k
        self._bufs = (torch.empty(self.world * t, packed, dtype=torch.uint8),
                      torch.ones(t, packed, dtype=torch.uint8),
                      torch.empty(t, x.shape[1], dtype=x.dtype),
                      torch.ones(self.world * t, x.shape[1], dtype=x.dtype))

    def dispatch(self) -> None:
        gathered, send = self._bufs[:2]
        dist.all_gather_single(gathered, send)

    def combine(self) -> None:
        out, partial = self._bufs[2:]
        dist.reduce_scatter_single(out, partial)

    def check(self, ref: ReferenceDispatch) -> str | None:
        return None

    def close(self) -> None:
        self._bufs = ()


class CopyBound:
    """The bytes dispatch and combine must move on this rank, copied once by one core.

    Dispatch must write each routed (token, expert) row of this rank once (with fp8, its
    bytes and its scales); combine must bring each received row back once. `dispatch()` and
    `combine()` copy exactly those byte counts, contiguous (memcpy between page-aligned
    buffers, the fastest copy this core has: `page_aligned` says why the alignment matters).
    The flag round trip is added when the results are summarised, not here.
    """

    def __init__(self, name: str, cfg: BenchConfig, hidden: int):
        self.name = name
        self.row_bytes = hidden * torch.empty(0, dtype=cfg.torch_dtype).element_size()
        rows = max(cfg.batches) * cfg.top_k * max(cfg.ranks)  # room for any skew
        # page-aligned, both: memcpy's fast case on every CPU (`page_aligned`)
        n = rows * self.row_bytes
        self._src, self._dst = page_aligned(n), page_aligned(n)
        self._src[:] = 1
        self.dispatch_bytes = self.combine_bytes = 0

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        # fp8 rows with scales: dispatch moves each row's fp8 bytes and its scales, combine
        # rows of the config's dtype (`row_bytes`, the larger: the buffers are sized for it)
        sent = self.row_bytes if not isinstance(x, tuple) else \
            sum(t.shape[1] * t.element_size() for t in x)
        self.dispatch_bytes = int((topk_idx >= 0).sum()) * sent
        self.combine_bytes = ref.recv_x.shape[0] * self.row_bytes

    def dispatch(self) -> None:
        n = self.dispatch_bytes
        np.copyto(self._dst[:n], self._src[:n])

    def combine(self) -> None:
        n = self.combine_bytes
        np.copyto(self._dst[:n], self._src[:n])

    def check(self, ref: ReferenceDispatch) -> str | None:
        return None

    def close(self) -> None:
        pass


def replay_calls(stats) -> list[tuple]:
    """The collectives a torch-backend call issued (its `Stats.extra["collectives"]`) as
    `all_to_all(group, *call)` replays them: `(out, in, out_splits, in_splits)` on
    preallocated uint8 buffers of the same bytes (the send side written: an untouched
    `torch.zeros` block maps every page to the kernel's one zero page, which a socket copy
    reads from cache, faster than any real rows)."""
    return [(torch.empty(sum(recv), dtype=torch.uint8), torch.ones(sum(send), dtype=torch.uint8),
             list(recv), list(send)) for _, send, recv in stats.extra["collectives"]]


class RawCollectives:
    """The torch backend's collectives alone: the same calls on the same bytes, nothing else.

    `prepare` runs dispatch and combine of a torch-backend Buffer (untimed) and reads from
    the stats of the last call which collectives it issued with how many bytes to and from
    each peer (`Stats.extra["collectives"]`); `dispatch()` and `combine()` then replay
    exactly those `all_to_all_single` calls, made as the backend makes them
    (`torch_backend.all_to_all`: on the process group object, not through the Python
    wrapper), on preallocated buffers (`replay_calls`). Two calls, because the
    backend sizes dispatch's first collective from the previous call (how many tokens ride
    inline): the second is the steady state the timed Buffer runs in. The torch backend's
    time over this line is what its own packing, reordering and reduction cost. The backend
    starts some of these collectives with `async_op=True` and does work that needs nothing
    from the peers before it waits; this line calls them synchronously (the same calls on
    the same bytes, with nothing to overlap).
    """

    def __init__(self, name: str, cfg: BenchConfig, hidden: int):
        import ubep

        self.name = name
        self.buf = ubep.Buffer(num_experts=cfg.experts, hidden=hidden,
                               max_tokens_per_rank=max(cfg.batches), backend="torch",
                               timeout_s=cfg.timeout_s, max_top_k=cfg.top_k)
        self._calls: dict[str, list] = {"dispatch": [], "combine": []}

    def prepare(self, x, topk_idx, topk_weights, ref: ReferenceDispatch) -> None:
        for _ in range(2):
            res = self.buf.dispatch(x, topk_idx, topk_weights)
            self.buf.combine(res.recv_x, res.handle)
        for op, st in (("dispatch", res.stats), ("combine", self.buf.last_stats)):
            self._calls[op] = replay_calls(st)

    def _replay(self, op: str) -> None:
        pg = dist.group.WORLD       # the group the Buffer above runs on
        for out, inp, recv, send in self._calls[op]:
            all_to_all(pg, out, inp, recv, send)

    def dispatch(self) -> None:
        self._replay("dispatch")

    def combine(self) -> None:
        self._replay("combine")

    def check(self, ref: ReferenceDispatch) -> str | None:
        return None

    def close(self) -> None:
        self.buf.close()


def make_system(name: str, cfg: BenchConfig, hidden: int, comm=None):
    """Build the system `name` on this rank (collective for the Buffer systems)."""
    if name in BUFFER_SYSTEMS:
        return BufferSystem(name, cfg, hidden)
    if name == "mpi":
        return MpiSystem(name, cfg, hidden, comm)
    if name == "agrs":
        return AgRsSystem(name, cfg, hidden)
    if name == BOUND:
        return CopyBound(name, cfg, hidden)
    if name == RAW:
        return RawCollectives(name, cfg, hidden)
    if name == AGRS_RAW:
        return AgRsCollectives(name, cfg, hidden)
    if name == MPI_RAW:
        return MpiCollectives(name, cfg, hidden, comm)
    raise ValueError(f"system {name!r} is unknown")
