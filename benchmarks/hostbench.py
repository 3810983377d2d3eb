"""Microbenchmarks of this host's memory system, for the host model (`benchmarks.host`).

What one byte of a row costs depends on where the bytes live: a call whose buffers stay in
a core's L2 copies several times faster than one that streams from DRAM, and two ranks
copying at once share the last-level cache and the memory bus. So every pass the shm
runtime makes over rows is timed here with the runtime's own kernels, on a footprint of
F bytes that the pass cycles through again and again (as `ubep bench` calls one operation
back to back), for F from 64 KiB to 128 MiB: by one process alone, and by two processes on
two cores at once (each with its own F), as the two ranks of a bench run do.

Passes (`ubep.runtime.shm.kernels`), timed per payload byte. Which side of a pass is small
matters: a dispatch sends each token row to top-k places, so its source (the batch) is an
eighth of what it writes and stays in cache, while the other passes stream both sides.

* copy_fanout: `copy_bytes` of rows into place, each source row to 8 places in turn (the
  one-worker receive of a rank's rows for itself, from `x`);
* record_write_fanout: `write_record` of rows as tff blocks, each source row to 8 places
  (the one-worker path's dispatch send to a peer);
* record_write: `write_record` of rows as tff blocks, one place per row (the one-worker
  combine sends a peer's expert outputs back);
* record_read: `blocks_ready` + `read_record` (the one-worker dispatch's receive from a peer);
* reduce: `sum_slots` (four rows a pass) of a token's 8 rows lying contiguous into its bf16
  output (the direct combine; the one-worker combine's rows of its own experts, read in
  place);
* reduce_blocks: the same over rows in tff blocks (the one-worker combine's rows from a
  peer's window);
* first_touch: writing fresh anonymous memory, one store per 4 KiB page (the page faults a
  newly allocated tensor takes when the allocator maps it fresh; per byte mapped).

Exchanges: passes whose cost depends on who touched the lines last and how recently, timed
as the runtime runs them, a write pass then the read pass of the same rows, round after
round (both processes in lockstep, a spinning barrier between the halves, as the ranks
spin while they wait; one process alone: it reads what it wrote itself). Each half is a
pass of its own in the table:

* dispatch_peer: `write_record` of rows as tff blocks, each source row to 8 places in
  expert-major order (`expert_places`), into the PEER's shared window, which the peer
  read last round (`record_write_fanout_peer`); then `blocks_ready` + `read_record` of my
  own window, which the peer just wrote (`record_read_peer`): the one-worker dispatch of a
  peer's rows. Each write takes the line from the core that read it last, each read
  fetches it from the core that wrote it.
* combine_peer: `write_record` of rows, one place per row, in expert-major order into the
  peer's window slots (token * 8 + k) (`record_write_peer`); then `sum_slots` of each
  token's 8 rows from my own window's blocks (`reduce_blocks_peer`): the one-worker
  combine of a peer's rows.
* direct: the direct path's dispatch as the runtime runs it (`copy_scatter`): each source
  row to its 8 places, a row for one of the peer's experts straight into the PEER's
  receive area, at its place in the runtime's layout (expert-major, the two sources' rows
  of an expert one after the other: a rank's rows sit between the peer's), copied by
  memcpy and each followed by a store fence and its 16-byte meta word (release) in the
  destination's meta array, then the wait until
  every row for me has its meta word (the dispatch returns when the peer's rows arrived);
  then `sum_slots` of each of my tokens' 8 rows where they lie, in either area
  (`reduce_scatter`: the direct combine, which reads a token's rows right after its
  dispatch wrote them, so at a reuse distance of one call, not of the whole cycle).
  Side by side at P=2 with the same kernels, the meta words and the wait for the peer
  added ~2 us per call at 64 and 128 rows per rank over rows written into one's own
  buffer (12.7 -> 14.6 and 24.4 -> 26.9 us).

Memory: every buffer is on 4 KiB pages, as the runtime's (its regions are shared memory,
which this kernel never backs with huge pages; torch's tensors are not advised to use
them). numpy's own allocations of 4 MiB and more are advised to use transparent huge pages
and would time a cheaper TLB than the runtime has: a scattered 16-32 MiB copy runs ~1.3x
faster on them on this host.

Timings are medians; the whole grid is timed `rounds` times in shuffled order and each point
keeps the median of its rounds, so a burst of other work on a shared host lands on few.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import random
import time
from dataclasses import dataclass

import numpy as np

from ubep.bench.systems import page_aligned
from ubep.runtime.shm.atomics import (
    cpu_pause,
    load_acquire,
    memcpy_at,
    store_fence,
    store_release,
)
from ubep.runtime.shm.direct.kernels import SUM_CHUNK
from ubep.runtime.shm.kernels import jit
from ubep.runtime.shm.kernels.combine import ELEM_BF16, sum_slots
from ubep.runtime.shm.kernels.records import (
    FMT_TFF,
    blocks_ready,
    copy_bytes,
    num_blocks,
    read_record,
    write_record,
)

CYCLED = ("copy_fanout", "record_write_fanout", "record_write", "record_read", "reduce",
          "reduce_blocks", "first_touch")
#: exchanges: (write pass, read pass) timed as a pair, round after round (see above)
EXCHANGES = {"dispatch_peer": ("record_write_fanout_peer", "record_read_peer"),
             "combine_peer": ("record_write_peer", "reduce_blocks_peer"),
             "direct": ("copy_scatter", "reduce_scatter")}
PASSES = CYCLED + tuple(p for pair in EXCHANGES.values() for p in pair)
#: the one-worker path's exchanges, in the order a call pair reaches their windows
WINDOWS = ("dispatch_peer", "combine_peer")
#: passes over lines the other process touched last
CROSS_CORE = EXCHANGES["dispatch_peer"] + EXCHANGES["combine_peer"]
#: the exchanges' passes: not forced monotone in footprint (`CopyTable.cost_ns_per_byte`),
#: as a pass one process cycles through its own buffers is: a round of two processes
#: carries fixed costs (the wait for the peer's rows) that fewer rows share, and it never
#: moves less than a token's rows
EXCHANGE_PASSES = tuple(p for pair in EXCHANGES.values() for p in pair)
#: footprints timed: 256 KiB .. 128 MiB, two per octave
FOOTPRINTS = tuple(int(2 ** (k / 2)) for k in range(36, 55))
#: fan-out passes: places each source row is written to (a token row goes to top-k experts)
FAN = 8
BLOCK_BYTES, FLAG_BYTES, HEAD_BYTES, TOP_K = 512, 8, 16, 8
PAGE = mmap.PAGESIZE
_BF16_ONE = 0x3F80          # rows of ones: no denormals, sums stay finite


@dataclass(frozen=True)
class CopyTable:
    """ns per payload byte of each pass at each footprint, one process alone ("1") and two
    at once ("2"); `row_bytes` is the row they were timed with."""

    row_bytes: int
    footprints: tuple[int, ...]
    ns_per_byte: dict            # (pass, procs) -> tuple of ns/B, one per footprint

    def to_dict(self) -> dict:
        return {"row_bytes": self.row_bytes, "footprints": list(self.footprints),
                "ns_per_byte": {f"{p}:{n}": list(v) for (p, n), v in self.ns_per_byte.items()}}

    @staticmethod
    def from_dict(d: dict) -> CopyTable:
        nb = {}
        for k, v in d["ns_per_byte"].items():
            p, n = k.rsplit(":", 1)
            nb[(p, int(n))] = tuple(float(x) for x in v)
        return CopyTable(int(d["row_bytes"]), tuple(int(f) for f in d["footprints"]), nb)

    def cost_ns_per_byte(self, pass_: str, footprint: float, procs: int = 2) -> float:
        """ns per byte of `pass_` for a call whose footprint is `footprint` bytes.

        Linear in log(footprint) between the timed points, the end values beyond them. A
        pass one process cycles through its own buffers is never cheaper than at a smaller
        footprint (a larger footprint cannot make a cache faster; the running maximum
        removes timing noise that says otherwise). An exchange's passes (`EXCHANGE_PASSES`)
        keep their measured shape: a cross-core pass's lines sit in the peer's cache while
        they fit there (dear), in the shared cache beyond (cheaper), in DRAM beyond that;
        and every exchange round has fixed costs (the wait for the peer's rows) that fewer
        rows share: the direct exchange at the hidden-64 footprints moves one token's 8
        rows of 14 KB (its minimum) at 0.7-0.9 us a row, at the batch-8 footprint 64 rows
        at 0.44-0.48; a running maximum priced the batch-8 call's rows at the one-token
        price.
        """
        y = np.asarray(self.ns_per_byte[(pass_, procs)], dtype=float)
        if pass_ not in EXCHANGE_PASSES:
            y = np.maximum.accumulate(y)
        x = np.log(np.asarray(self.footprints, dtype=float))
        return float(np.interp(np.log(max(float(footprint), 1.0)), x, y))

    def GBps(self, pass_: str, footprint: float, procs: int = 2) -> float:
        """The same as GB/s."""
        return 1.0 / self.cost_ns_per_byte(pass_, footprint, procs)


def record_wire_bytes(row_bytes: int, head_bytes: int = HEAD_BYTES) -> int:
    """Bytes a tff record of `head_bytes` + `row_bytes` occupies (blocks of 512, 8-byte
    flag each), as `write_record` lays it out."""
    return num_blocks(head_bytes + row_bytes, BLOCK_BYTES - FLAG_BYTES) * BLOCK_BYTES


# -- the timed passes: `reps` passes over `n` rows each, the runtime's kernels ----------------
@jit
def _copy(src, dst, n, reps):
    m, rb = src.shape
    d0 = dst.ctypes.data
    for _ in range(reps):
        for i in range(n):
            copy_bytes(d0 + i * rb, src[i % m].ctypes.data, rb)


@jit
def _record_write(src, dst, n, wire, reps, epoch):
    m, rb = src.shape
    head = np.zeros(HEAD_BYTES, np.uint8)
    ppb = BLOCK_BYTES - FLAG_BYTES
    nb = num_blocks(HEAD_BYTES + rb, ppb)
    d0 = dst.ctypes.data
    for r in range(reps):
        for i in range(n):
            write_record(d0 + i * wire, BLOCK_BYTES, ppb, FMT_TFF, head, HEAD_BYTES,
                         src[i % m], rb, epoch + r, i * nb)


@jit
def _record_read(src, out, wire, reps, epoch):
    n, rb = out.shape
    head = np.zeros(HEAD_BYTES, np.uint8)
    ppb = BLOCK_BYTES - FLAG_BYTES
    nb = num_blocks(HEAD_BYTES + rb, ppb)
    s0 = src.ctypes.data
    missing = 0
    for _ in range(reps):
        for i in range(n):
            a = s0 + i * wire
            if not blocks_ready(a, nb, BLOCK_BYTES, FMT_TFF, epoch):
                missing += 1
            read_record(a, BLOCK_BYTES, ppb, head, HEAD_BYTES, out[i], rb)
    return missing


@jit
def _reduce(src, stride, blk, epb, out16, reps):
    """Each token's 8 rows (`stride` bytes apart, blocks of `epb` elements `blk` bytes
    apart) summed into its bf16 output row, as the runtime's reduce calls `sum_slots`."""
    lut = np.zeros(1, np.float32)
    s0 = src.ctypes.data
    srcs = np.empty(TOP_K, np.int64)
    blks = np.full(TOP_K, blk, np.int64)
    wgts = np.full(TOP_K, 0.5, np.float32)
    acc = np.empty(epb, np.float32)
    no_y = np.zeros(0, np.float32)
    for _ in range(reps):
        for t in range(out16.shape[0]):
            for j in range(TOP_K):
                srcs[j] = s0 + (t * TOP_K + j) * stride
            sum_slots(srcs, blks, wgts, TOP_K, epb, 2, ELEM_BF16, lut, acc, no_y, out16[t])


def _first_touch(nbytes: int, reps: int) -> None:
    for _ in range(reps):
        m = mmap.mmap(-1, nbytes)
        a = np.frombuffer(m, np.uint8)
        a[::PAGE] = 1
        del a
        m.close()


def expert_places(rows: int, fan: int = FAN, experts: int = 2 * FAN, seed: int = 0
                  ) -> np.ndarray:
    """Where row i = t * fan + j (token t's j-th expert) lies in an expert-major layout:
    each token routed to `fan` distinct experts of `experts` (uniform, seeded), the rows of
    expert 0 first, then expert 1, ... (token order within an expert), as the runtime lays
    out its receive areas and windows. `rows` is rounded down to whole tokens."""
    t_n = rows // fan
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((t_n, experts)), axis=1)[:, :fan].ravel()
    order = np.argsort(idx, kind="stable")           # expert-major, token order within
    places = np.empty(t_n * fan, np.int64)
    places[order] = np.arange(t_n * fan)
    return places


@jit
def _record_write_places(src, dst, places, fan, wire, hl, epoch):
    """`write_record` of `src[i // fan]` (after an `hl`-byte header) to record `places[i]`
    of `dst` (records `wire` bytes apart)."""
    rb = src.shape[1]
    head = np.zeros(HEAD_BYTES, np.uint8)
    ppb = BLOCK_BYTES - FLAG_BYTES
    nb = num_blocks(hl + rb, ppb)
    d0 = dst.ctypes.data
    for i in range(places.shape[0]):
        q = places[i]
        write_record(d0 + q * wire, BLOCK_BYTES, ppb, FMT_TFF, head, hl, src[i // fan], rb,
                     epoch, q * nb)


def direct_places(t_n: int, fan: int = FAN, experts: int = 2 * FAN
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The direct path's layout of two sources' rows, `t_n` tokens each routed to `fan`
    distinct experts of `experts` (uniform, seeded by the source: source 0's routing is
    `expert_places`'), the first half of the experts on rank 0: `(dest [2, t_n * fan],
    place [2, t_n * fan], rows [2])` -- for row i = t * fan + j of source s its
    destination rank and its row in that rank's receive area (expert-major; within an
    expert, source 0's rows, then source 1's, token order within), and the rows each
    destination receives."""
    half = experts // 2
    idx = np.stack([np.argsort(np.random.default_rng(s).random((t_n, experts)),
                               axis=1)[:, :fan].ravel() for s in (0, 1)])
    dest = idx // half
    place = np.empty_like(idx)
    rows = np.zeros(2, np.int64)
    for d in (0, 1):
        src, row = np.nonzero(dest == d)
        order = np.lexsort((row, src, idx[src, row]))      # expert, then source, then row
        place[src[order], row[order]] = np.arange(order.size)
        rows[d] = order.size
    return dest.astype(np.int64), place.astype(np.int64), rows


@jit
def _copy_direct(src, fan, dest, place, areas, metas, epoch):
    """Row i of my sources (`src[i // fan]`) to row `place[i]` of destination `dest[i]`'s
    area (address `areas[d]`) by memcpy and a store fence, then its meta word (release) at
    `metas[d] + 16 * place`: as the runtime's `send_rows_direct` writes a row."""
    rb = src.shape[1]
    for i in range(dest.shape[0]):
        d = dest[i]
        q = place[i]
        memcpy_at(areas[d] + q * rb, src[i // fan].ctypes.data, rb)
        store_fence()
        store_release(metas[d] + q * 16 + 8, epoch)


@jit
def _metas_arrived(meta, places, epoch, max_spins):
    """Spin (pause) until the meta word of every row in `places` holds `epoch`; False
    after `max_spins` pauses (the caller backs off and keeps its deadline)."""
    spins = 0
    for i in range(places.shape[0]):
        while load_acquire(meta + places[i] * 16 + 8) != epoch:
            cpu_pause()
            spins += 1
            if spins > max_spins:
                return False
    return True


@jit
def _reduce_addrs(addrs, out16):
    """Each token's 8 rows (at `addrs[t * 8 + j]`) summed into its bf16 output row, as
    the direct combine calls `sum_slots` on rows where they lie."""
    lut = np.zeros(1, np.float32)
    srcs = np.empty(TOP_K, np.int64)
    blks = np.full(TOP_K, SUM_CHUNK * 2, np.int64)
    wgts = np.full(TOP_K, 0.5, np.float32)
    acc = np.empty(SUM_CHUNK, np.float32)
    no_y = np.zeros(0, np.float32)
    for t in range(out16.shape[0]):
        for j in range(TOP_K):
            srcs[j] = addrs[t * TOP_K + j]
        sum_slots(srcs, blks, wgts, TOP_K, SUM_CHUNK, 2, ELEM_BF16, lut, acc, no_y, out16[t])


def _spin_wait(burst, timeout_s: float, what: str) -> None:
    """Call `burst()` (a bounded spin, ~1 ms; True once done) until it succeeds, yielding the
    core between bursts; `TimeoutError` naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not burst():
        if time.monotonic() > end:
            raise TimeoutError(f"hostbench: {what} within {timeout_s} s")
        os.sched_yield()


def _wait_metas(meta: int, places: np.ndarray, epoch: int, timeout_s: float = 60.0) -> None:
    """`_metas_arrived` in bursts, yielding between them, up to `timeout_s`."""
    _spin_wait(lambda: _metas_arrived(meta, places, epoch, 1 << 14), timeout_s,
               f"the peer's rows (epoch {epoch}) did not arrive")


def _setup(pass_: str, footprint: int, row_bytes: int):
    """(run(reps), payload bytes per pass) of `pass_` on buffers totalling ~`footprint`."""
    rb = row_bytes
    wire = record_wire_bytes(rb)
    hidden = rb // 2
    if pass_ == "copy_fanout":
        n = max(FAN, footprint // (rb + rb // FAN) // FAN * FAN)
        src, dst = page_aligned(n // FAN * rb).reshape(n // FAN, rb), page_aligned(n * rb)
        src[:] = 1
        return (lambda reps: _copy(src, dst, n, reps)), n * rb
    if pass_ == "record_write_fanout":
        n = max(FAN, footprint // (wire + rb // FAN) // FAN * FAN)
        src, dst = page_aligned(n // FAN * rb).reshape(n // FAN, rb), page_aligned(n * wire)
        src[:] = 1
        return (lambda reps: _record_write(src, dst, n, wire, reps, 2)), n * rb
    if pass_ in ("record_write", "record_read"):
        n = max(1, footprint // (rb + wire))
        src, dst = page_aligned(n * rb).reshape(n, rb), page_aligned(n * wire)
        src[:] = 1
        _record_write(src, dst, n, wire, 1, 1)
        if pass_ == "record_write":
            return (lambda reps: _record_write(src, dst, n, wire, reps, 2)), n * rb
        return (lambda reps: _record_read(dst, src, wire, reps, 1)), n * rb
    if pass_ in ("reduce", "reduce_blocks"):
        blocks = pass_ == "reduce_blocks"
        ppb = BLOCK_BYTES - FLAG_BYTES
        stride = num_blocks(rb, ppb) * BLOCK_BYTES if blocks else rb
        epb, blk = (ppb // 2, BLOCK_BYTES) if blocks else (SUM_CHUNK, SUM_CHUNK * 2)
        tokens = max(1, footprint // (TOP_K * stride + rb))
        src = page_aligned(tokens * TOP_K * stride)
        src.view(np.uint16)[:] = _BF16_ONE
        out16 = page_aligned(tokens * rb).view(np.uint16).reshape(tokens, hidden)
        return (lambda reps: _reduce(src, stride, blk, epb, out16, reps)), tokens * TOP_K * rb
    if pass_ == "first_touch":
        n = max(1, footprint // PAGE) * PAGE
        return (lambda reps: _first_touch(n, reps)), n
    raise ValueError(f"pass {pass_!r} is not one of {CYCLED}")


def _rows(rows: np.ndarray, n: int, rb: int) -> np.ndarray:
    """The first `n` rows of `rows` (uint8, `[>= n, rb]`), named if too few."""
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[1] != rb or rows.shape[0] < n:
        raise ValueError(f"rows must be uint8 [>= {n}, {rb}], got {rows.dtype} {rows.shape}")
    return rows[:n]


def _exchange_setup(name: str, footprint: int, row_bytes: int, own: np.ndarray,
                    peer: np.ndarray, me: int = 0, rows: np.ndarray | None = None):
    """(write(epoch), read(epoch), payload bytes of each) of exchange `name` with ~`footprint`
    bytes of this process's own: the write goes into `peer` (the other process's shared
    buffer, or `own` when alone), the read comes from `own`, which the peer wrote; direct:
    into either, as the routing says, and `me` (0 or 1) is this process's rank. Buffers
    hold `shared_bytes([footprint], row_bytes)`. `rows` (one-worker exchanges): the dispatch's
    receive area / the combine's source rows, `[n, row_bytes]` uint8 of at least the rows
    the exchange moves (default: its own): the combine sends back what the dispatch
    received, as the runtime's combine sends its `expert_out`, the dispatch's `recv_x`."""
    rb = row_bytes
    hidden = rb // 2
    if name == "dispatch_peer":
        wire = record_wire_bytes(rb)
        n = max(FAN, footprint // (wire + rb + rb // FAN) // FAN * FAN)
        src = page_aligned(n // FAN * rb).reshape(n // FAN, rb)
        src[:] = 1
        out = page_aligned(n * rb).reshape(n, rb) if rows is None else _rows(rows, n, rb)
        places = expert_places(n)
        return (lambda e: _record_write_places(src, peer, places, FAN, wire, HEAD_BYTES, e),
                lambda e: _record_read(own, out, wire, 1, e), n * rb)
    if name == "combine_peer":
        wire = record_wire_bytes(rb, 0)
        n = max(TOP_K, footprint // (wire + rb + rb // TOP_K) // TOP_K * TOP_K)
        src = page_aligned(n * rb).reshape(n, rb) if rows is None else _rows(rows, n, rb)
        src.view(np.uint16)[:] = _BF16_ONE
        out16 = page_aligned(n // TOP_K * rb).view(np.uint16).reshape(n // TOP_K, hidden)
        # the expert side sends its rows in its (expert-major) order to slot token*8 + k
        slots = np.argsort(expert_places(n)).astype(np.int64)
        ppb = BLOCK_BYTES - FLAG_BYTES
        return (lambda e: _record_write_places(src, peer, slots, 1, wire, 0, e),
                lambda e: _reduce(own, wire, BLOCK_BYTES, ppb // 2, out16, 1), n * rb)
    if name == "direct":
        n, (dest, place, rows), slot = _direct_layout(footprint, rb)
        src = page_aligned(n // FAN * rb).reshape(n // FAN, rb)
        src.view(np.uint16)[:] = _BF16_ONE
        out16 = page_aligned(n // FAN * rb).view(np.uint16).reshape(n // FAN, hidden)
        alone = own is peer
        # destination d's area and meta words: in d's buffer (alone: both in mine), at slot d
        bufs = (own, peer) if me == 0 else (peer, own)
        areas = np.array([bufs[d].ctypes.data + d * slot for d in (0, 1)], np.int64)
        metas = areas + int(rows.max()) * rb
        mine_dest, mine_place = dest[me], place[me]
        # rows for me from the peer (alone: none to wait for; its rows are not written)
        theirs = np.sort(place[1 - me][dest[1 - me] == me]) if not alone else place[0][:0]
        addrs = areas[mine_dest] + mine_place * rb

        def write(e: int) -> None:
            _copy_direct(src, FAN, mine_dest, mine_place, areas, metas, e)
            if theirs.size:
                _wait_metas(int(metas[me]), theirs, e)

        def read(e: int) -> np.ndarray:
            _reduce_addrs(addrs, out16)
            return out16                              # my tokens' sums (for tests)

        return write, read, n * rb
    raise ValueError(f"exchange {name!r} is not one of {tuple(EXCHANGES)}")


def _direct_layout(footprint: int, rb: int):
    """The direct exchange at `footprint`: its rows `n` (at least `FAN`, one token),
    `direct_places`' layout and the bytes of one destination's slot (its rows and meta
    words, page-rounded)."""
    n = max(FAN, footprint // (rb + 2 * rb // FAN) // FAN * FAN)
    places = direct_places(n // FAN)
    return n, places, -(-(int(places[2].max()) * (rb + 16)) // PAGE) * PAGE


def shared_bytes(footprints, row_bytes: int) -> int:
    """Bytes of each process's shared buffer: twice the largest footprint (the record
    exchanges), or the direct exchange's two destination slots where they are more (small
    footprints: it moves at least one token's `FAN` rows, ~230 KB at 14 KB rows), and the
    barrier's page."""
    direct = max(2 * _direct_layout(f, row_bytes)[2] for f in footprints)
    return max(2 * max(footprints), direct) + 2 * PAGE


@jit
def _spin_until(addr, me, n, value, max_spins):
    """Publish `value` in word `me` of the `n` words at `addr`, then spin (pause) until every
    word holds at least `value`; False after `max_spins` pauses (the caller backs off)."""
    store_release(addr + 8 * me, value)
    spins = 0
    for i in range(n):
        while load_acquire(addr + 8 * i) < value:
            cpu_pause()
            spins += 1
            if spins > max_spins:
                return False
    return True


class SpinBarrier:
    """A barrier of `n` processes on shared words at `addr` that spins, as the runtime's
    ranks do while they wait for each other, instead of sleeping: a process woken from a
    sleep in this VM finds its caches cooled, which a spinning rank does not. Spins in
    bursts of ~1 ms, yields between bursts, and gives up after `timeout_s`."""

    def __init__(self, addr: int, me: int, n: int, timeout_s: float = 60.0):
        self.addr, self.me, self.n, self.timeout_s = addr, me, n, timeout_s
        self.value = 0

    def wait(self) -> None:
        self.value += 1
        _spin_wait(lambda: _spin_until(self.addr, self.me, self.n, self.value, 1 << 14),
                   self.timeout_s, f"process {self.me}: the other did not reach an "
                   "exchange's barrier")


def exchange_rounds(footprint: int, seconds: float) -> int:
    """Rounds an exchange is timed for at `footprint` (the same in every process: they
    meet at a barrier twice a round): about `seconds` at ~10 GB/s, 5 to 50."""
    return int(min(50, max(5, seconds * 2e9 / max(footprint, 1))))


def time_exchange(name: str, footprint: int, row_bytes: int, own: np.ndarray,
                  peer: np.ndarray, seconds: float, barrier, me: int = 0, setup=None,
                  epoch0: int = 2, warmup: int = 1, rounds: int | None = None
                  ) -> tuple[float, float]:
    """ns per payload byte of the write and of the read half of exchange `name`: every
    round, all processes write (into their peer's buffer), meet at `barrier`, read (their
    own), meet again; `warmup` untimed rounds, then `rounds` timed ones (default
    `exchange_rounds(footprint, seconds)`), the median timed round of each half. `setup`:
    an `_exchange_setup` result to reuse (timed again and again); rounds use epochs
    `epoch0`, `epoch0 + 1`, ... (`warmup + rounds` of them), which a caller timing the
    same buffers again starts past the last ones used, so no stale word reads as new.

    Which rounds are timed matters at large footprints: after other memory traffic a round
    of the direct exchange at the batch-128 footprint (18 MB a rank) cost 1.7 us per row,
    and each further round of the same exchange less, ~0.8 after 12-15 rounds (the
    runtime's calls alike, side by side). So a table that predicts calls 4-13 of a run of
    the bench's calls times rounds 4-13 (`warmup=3, rounds=10`), not rounds 2-6."""
    write, read, nbytes = setup or _exchange_setup(name, footprint, row_bytes, own, peer, me)
    rounds = exchange_rounds(footprint, seconds) if rounds is None else rounds
    if warmup < 0 or rounds < 1:
        raise ValueError(f"warmup={warmup} must be >= 0 and rounds={rounds} >= 1")
    tw, tr = [], []
    for r in range(warmup + rounds):
        w, rd = _timed_round(write, read, epoch0 + r, barrier)
        if r >= warmup:
            tw.append(w)
            tr.append(rd)
    return float(np.median(tw)) / nbytes, float(np.median(tr)) / nbytes


def _timed_round(write, read, epoch: int, barrier) -> tuple[int, int]:
    """One round of an exchange: every process writes (epoch `epoch`), meets at `barrier`,
    reads; (write ns, read ns) of this process."""
    barrier.wait()
    t0 = time.perf_counter_ns()
    write(epoch)
    t1 = time.perf_counter_ns()
    barrier.wait()
    t2 = time.perf_counter_ns()
    read(epoch)
    return t1 - t0, time.perf_counter_ns() - t2


def window_setups(footprint: int, row_bytes: int, own: np.ndarray, peer: np.ndarray,
                  me: int = 0, copies: int = 2) -> dict:
    """The one-worker path's windows as the bench's calls use them: `{(exchange, copy):
    setup}` for the dispatch and the combine exchange (`_exchange_setup`) and each of
    `copies` window sets (the runtime's parities), every one on its own part of `own` and
    `peer` (none overlapping, as the runtime's windows do not), all of them together about
    `footprint` bytes of this process's own (each sized for `footprint / (2 * copies)`).
    Each copy's combine sends back the rows its dispatch received (the runtime's combine
    sends `expert_out`, the dispatch's `recv_x`, which this core has just written)."""
    part = footprint // (2 * copies)
    step = -(-part // PAGE) * PAGE
    wire = min(record_wire_bytes(row_bytes), record_wire_bytes(row_bytes, 0))
    n = max(FAN, part // (wire + row_bytes + row_bytes // FAN) // FAN * FAN)
    out, k = {}, 0
    for c in range(copies):
        received = page_aligned(n * row_bytes).reshape(n, row_bytes)
        for name in WINDOWS:
            o = k * step
            out[(name, c)] = _exchange_setup(name, part, row_bytes, own[o:o + step],
                                             peer[o:o + step], me, rows=received)
            k += 1
    return out


def bench_order(keys, calls: int, warmup: int = 2, per_call: int = len(WINDOWS)) -> list:
    """`[(key, timed), ...]`: `keys` in turn, `per_call` of them a bench call (a dispatch's
    and its combine's window: the bench's dispatch, combine, then the next call's parity's),
    for `warmup` untimed calls, then `calls` timed ones: the order the bench's calls reach
    the windows `keys` name, and the calls of a run it times (`ubep bench` and the
    validation's chunks time calls `warmup + 1 ...` of each run)."""
    if warmup < 0 or calls < 1 or per_call < 1:
        raise ValueError(f"calls={calls} and per_call={per_call} must be >= 1, "
                         f"warmup={warmup} >= 0")
    n = len(keys)
    return [(keys[(c * per_call + j) % n], c >= warmup) for c in range(warmup + calls)
            for j in range(per_call)]


def time_rounds(setups: dict, order: list, barrier, epoch0: int = 2) -> dict:
    """One round of exchange `setups[key]` for each `(key, timed)` of `order`, in that order:
    all processes write (into their peer's buffer), meet at `barrier`, read (their own), meet
    again. Returns `{key: [(write ns/B, read ns/B), ...]}` of the timed rounds. Round i uses
    epoch `epoch0 + i` (the order must be the same on every process); a caller timing the
    same buffers again starts past `epoch0 + len(order)`."""
    out: dict = {k: [] for k, _ in order}
    for i, (k, timed) in enumerate(order):
        write, read, nbytes = setups[k]
        w, rd = _timed_round(write, read, epoch0 + i, barrier)
        if timed:
            out[k].append((w / nbytes, rd / nbytes))
    return out


def time_windows(footprint: int, row_bytes: int, own: np.ndarray, peer: np.ndarray,
                 seconds: float, barrier, me: int = 0, copies: int = 2, setup=None,
                 epoch0: int = 2, warmup: int = 2, calls: int | None = None) -> dict:
    """ns per payload byte of the one-worker path's four cross-core passes at `footprint`,
    timed as the bench's calls meet its windows (`window_setups`, `bench_order`): the
    dispatch's and the combine's exchange in turn, each parity's windows in turn, so a
    window is written again only after the other three were used, as in the bench;
    `warmup` untimed calls (a dispatch and a combine round each), then `calls` timed ones
    (default: two per `exchange_rounds(footprint, seconds)`). Per pass the median over its
    rounds of both parities: `{pass: ns/B}`. Uses `len(bench_order(...))` =
    `(warmup + calls) * len(WINDOWS)` epochs from `epoch0`.

    Why: a window visited again right after its last round (an exchange's rounds back to
    back) finds its lines where that round left them, in the peer's caches; measured side
    by side at the batch-1 footprint, 8 records a round: 3.05-3.1 us per row written into
    the peer's slots and 3.4-3.5 us per row summed back to back, 1.7-1.8 and 1.9 when each
    round came after other work, as the bench's calls do (the same at batch 8 either
    way)."""
    setups = setup or window_setups(footprint, row_bytes, own, peer, me, copies)
    keys = list(setups)
    calls = 2 * exchange_rounds(footprint, seconds) if calls is None else calls
    got = time_rounds(setups, bench_order(keys, calls, warmup), barrier, epoch0)
    out = {}
    for name, (wname, rname) in ((n, EXCHANGES[n]) for n in WINDOWS):
        rounds = [v for (n, _), vs in got.items() if n == name for v in vs]
        out[wname] = float(np.median([w for w, _ in rounds]))
        out[rname] = float(np.median([r for _, r in rounds]))
    return out


def time_pass(pass_: str, footprint: int, row_bytes: int, seconds: float,
              barrier=None, setup=None) -> float:
    """ns per payload byte of `pass_` cycling through `footprint` bytes: the median of
    timings of at least ~100 us each, taken for `seconds` (after one warm pass). With a
    `barrier`, the timing starts when every process reached it. `setup`: a `_setup`
    result to reuse."""
    run, nbytes = setup or _setup(pass_, footprint, row_bytes)
    run(1)                                       # compiled, buffers touched
    t = time.perf_counter()
    run(1)
    reps = max(1, int(100e-6 / max(time.perf_counter() - t, 1e-9)))
    if barrier is not None:
        barrier.wait()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t = time.perf_counter_ns()
        run(reps)
        times.append((time.perf_counter_ns() - t) / reps)
    return float(np.median(times)) / nbytes


def map_segments(segments) -> tuple[list[mmap.mmap], list[np.ndarray]]:
    """Map each `(path, size)` of `segments` read-write: (the mappings, each as uint8)."""
    maps = []
    for path, size in segments:
        fd = os.open(path, os.O_RDWR)
        try:
            maps.append(mmap.mmap(fd, size))
        finally:
            os.close(fd)
    return maps, [np.frombuffer(m, np.uint8) for m in maps]


def _worker(core: int, points, row_bytes: int, seconds: float, barrier, queue,
            segments, mine: int) -> None:
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    maps, bufs = map_segments(segments)          # the exchanges' shared buffers
    # the exchanges' barrier: words on the last page of the first buffer (no exchange
    # reaches it: `shared_bytes` leaves it out), spun on rather than slept in
    spin = SpinBarrier(bufs[0].ctypes.data + bufs[0].nbytes - PAGE, mine, len(bufs)) \
        if bufs else None
    out = []
    for p, f in points:
        if p in EXCHANGES:
            own, peer = bufs[mine], bufs[(mine + 1) % len(bufs)]
            barrier.wait()                       # both at this point; then spin per round
            out.append(time_exchange(p, f, row_bytes, own, peer, seconds, spin, mine))
        else:
            out.append((time_pass(p, f, row_bytes, seconds, barrier),))
    queue.put((core, out))


def measure(row_bytes: int = 7168 * 2, passes=PASSES, footprints=FOOTPRINTS,
            seconds: float = 0.02, procs=(1, 2), rounds: int = 3, seed: int = 0) -> CopyTable:
    """Time every pass at every footprint with 1 and 2 processes (cores 0 and 1) at once.

    Two processes run the same passes in lockstep (a barrier before each point), each on
    its own buffers; their median per point is the two-rank figure. An exchange's passes
    (`EXCHANGES`) are timed together, the processes writing into each other's shared
    buffers (one process: into its own). The grid is timed `rounds` times, each in its own
    shuffled order; a point keeps its median round. About `rounds * len(passes) *
    len(footprints) * seconds` per process count, plus setup.
    """
    wanted = [p for p in CYCLED if p in passes] + \
        [x for x, pair in EXCHANGES.items() if set(pair) & set(passes)]
    grid = [(p, f) for p in wanted for f in footprints]
    rng = random.Random(seed)
    points = []
    for _ in range(rounds):
        points += rng.sample(grid, len(grid))
    ctx = mp.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0, 1]
    table = {}
    for n in procs:
        if n > len(cores):
            raise ValueError(f"procs={n}: this process may run on {len(cores)} core(s) only")
        segments = _segments(n, shared_bytes(footprints, row_bytes)) \
            if set(wanted) & set(EXCHANGES) else []
        try:
            barrier, queue = ctx.Barrier(n), ctx.Queue()
            ps = [ctx.Process(target=_worker, args=(cores[i], points, row_bytes, seconds,
                                                     barrier, queue, segments, i), daemon=True)
                  for i in range(n)]
            for p in ps:
                p.start()
            try:
                got = _collect(queue, ps, deadline=time.monotonic() + 900)
            finally:
                for p in ps:
                    p.join(timeout=30)
                    if p.is_alive():
                        p.kill()
        finally:
            for path, _ in segments:
                os.unlink(path)
        per_point = np.median(_stack(got), axis=0)                      # over processes
        by = {}
        for (p, f), v in zip(points, per_point):
            by.setdefault((p, f), []).append(v)
        for p in wanted:
            names = EXCHANGES.get(p, (p,))
            for i, name in enumerate(names):
                table[(name, n)] = tuple(float(np.median([v[i] for v in by[(p, f)]]))
                                         for f in footprints)
    return CopyTable(row_bytes=row_bytes, footprints=tuple(footprints), ns_per_byte=table)


def _collect(queue, ps, deadline: float) -> list:
    """One result per process from `queue`; an error naming the exit code if a process
    ended without one (instead of waiting out the deadline)."""
    import queue as q

    got = []
    while len(got) < len(ps):
        try:
            got.append(queue.get(timeout=0.5))
        except q.Empty:
            dead = [p.exitcode for p in ps if not p.is_alive() and p.exitcode != 0]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"hostbench: a timing process failed (exit codes {dead}) "
                                   "or timed out") from None
    return got


def _stack(got) -> np.ndarray:
    """The processes' results `[procs, points, 2]` (a cycled pass's single value padded)."""
    return np.array([[tuple(v) + (float("nan"),) * (2 - len(v)) for v in g[1]] for g in got])


def _segments(n: int, size: int) -> list[tuple[str, int]]:
    """One shared buffer of `size` bytes per process, as files in /dev/shm (or the temp
    folder), removed by the caller: (path, size)."""
    import tempfile

    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    out = []
    for i in range(n):
        path = os.path.join(folder, f"ubep-hostbench-{os.getpid()}-{i}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        out.append((path, size))
    return out
