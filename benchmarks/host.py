"""The `host` model: the simulator's engine with this machine's constants, checked against
`ubep bench` on this machine (`python -m benchmarks validate-host`).

Ranks are processes sharing one host's memory: one hop class, no port limit, one worker
per rank on 2 cores. A core never waits for its stores to be seen by the peer (the copy
is its cost; visibility follows half a flag round trip later), so a worker's rows in flight
are not limited by the hop (`staging_rows` deep enough never to fill). What a row costs
is what the runtime does to it (`ubep.runtime.shm`), priced by microbenchmarks of the
runtime's own kernels on this host (`benchmarks.hostbench`), not fitted to the points
predicted:

* the passes over rows (`ROW_PASSES`): the one-worker path (shm-ubep, shm-bsp) writes each
  row for the peer as a tff record into the peer's window and the peer reads it out into
  place; a rank's rows for itself skip the window (copied from `x` on receive). Combine
  sends the peer's expert outputs back the same way and sums each token's rows into its
  bf16 output (`sum_slots`: from the window's blocks, or in place for its own experts).
  The records cross cores: the sender's stores take lines the peer read last, the peer's
  loads fetch lines the sender just wrote; priced by passes timed as exactly that exchange
  between two processes (`hostbench.EXCHANGES`), not by a copy within one core.
  The direct path copies each row once into its final place in expert-major order
  (dispatch) and sums the rows where they lie (combine), where the rank reads back rows it
  wrote itself one call before. Rows for the peer vs for itself: `remote_share` (of the
  bench's routing);
* a pass's cost per byte depends on the call's footprint: the bytes a rank's calls cycle
  through (its input, windows or its receive area, outputs),
  looked up in the microbenchmark's table of the same pass timed on that footprint with
  two processes copying at once (both ranks move rows at the same time, sharing the last
  level cache and the memory bus);
* fresh pages: a tensor the runtime allocates per call (the dispatch's `recv_x`, the
  combine's output) may come from memory the allocator maps fresh, and its first touch
  then faults every page. How many pages a call faults is counted (`count_faults`: the
  runtime in the bench's calling pattern, ranks' minor faults around each call; a count,
  not a time) and each faulted page is priced at the microbenchmark's first-touch cost;
* flag round trip: the bench's own ping-pong between the two ranks (`run.json`); a store
  becomes visible to the peer half a round trip after it was written;
* per-call overhead (Python, torch tensors, planning, counts, per-row bookkeeping): the same
  bench run at hidden 64 (a row of 128 bytes, a call's rows at most 256 KB) at the same
  batch, minus the model's data movement for that call. Measured at every batch, so
  bookkeeping that grows with the rows is measured, not assumed; each of those calls
  right after a hidden-7168 call (`hostchunks._time_cold`), whose traffic leaves the
  caller's working set out of cache, as every hidden-7168 call finds it; and each lending
  its outputs as the hidden-7168 call does (`hostchunks.lend_as_at`: the runtime's output
  pool lends 256 KiB and more from kept blocks, in Python, and leaves smaller outputs to
  `torch.empty`, so by bytes alone a hidden-64 call would take the cheaper way).

Then the engine predicts the bench medians of shm-bsp, shm-ubep and shm-direct at hidden
7168 bf16, top-8, P=2, on the routing the bench runs (`bench_topk`: the bench's own draw
at each batch and hidden, not the simulator's).
"""

from __future__ import annotations

import fcntl
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from benchmarks.hostbench import PAGE, CopyTable, record_wire_bytes

SYSTEMS = {"shm-bsp": ("bsp", False), "shm-ubep": ("ubep", False),
           "shm-direct": ("ubep", True)}
BATCHES = (1, 8, 16, 128)
HIDDEN, TINY_HIDDEN, TOP_K, EXPERTS, RANKS = 7168, 64, 8, 16, 2
BYTES_PER_ELEMENT = 2
BENCH_LOCK = "/tmp/ubep-bench.lock"
#: the passes over rows of each path and op: {side: ((pass, rows it applies to), ...)}, the
#: sender's and the receiver's; "remote" rows go to / come from the peer, "all" every row.
#: The one-worker path's records cross cores: a sender writes lines of the peer's window that
#: the peer read last, the peer then reads lines the sender just wrote (the `_peer` passes,
#: timed as such an exchange); its own rows never leave its core. The direct path's rows are
#: read back by the rank that wrote them (its own tokens' rows, wherever they lie), one call
#: after they were written (`copy_scatter` then `reduce_scatter`, timed in that order).
ROW_PASSES = {
    ("single", "dispatch"): {"send": (("record_write_fanout_peer", "remote"),),
                             "recv": (("record_read_peer", "remote"), ("copy_fanout", "local"))},
    ("single", "combine"): {"send": (("record_write_peer", "remote"),),
                            "recv": (("reduce_blocks_peer", "remote"),
                                     ("reduce_scatter", "local"))},
    ("direct", "dispatch"): {"send": (("copy_scatter", "all"),), "recv": ()},
    ("direct", "combine"): {"send": (("reduce_scatter", "all"),), "recv": ()},
}


@dataclass(frozen=True)
class HostConstants:
    """The microbenchmarked constants of this host."""

    table: CopyTable           # ns per byte of every pass by footprint (`hostbench`)
    flag_rtt_us: float
    call_us: dict              # (system, op, batch) -> per-call overhead, us
    faults: dict               # (system, op, batch) -> pages faulted per call (hidden 7168)

    def to_dict(self) -> dict:
        return {"copy_table": self.table.to_dict(), "flag_rtt_us": self.flag_rtt_us,
                "call_us": {f"{s}:{o}:{b}": v for (s, o, b), v in self.call_us.items()},
                "faults": {f"{s}:{o}:{b}": v for (s, o, b), v in self.faults.items()}}


def path_of(system: str) -> str:
    """"direct" for shm-direct, else "single" (the one-worker path, ubep or bsp order)."""
    return "direct" if SYSTEMS[system][1] else "single"


@functools.cache
def bench_topk(batch: int, hidden: int = HIDDEN, seed: int = 0) -> np.ndarray:
    """The routing `ubep bench` runs at this batch and hidden (`ubep.bench.runner.bench_inputs`,
    seed `seed`, as the validation's chunks run it): `[RANKS, batch, TOP_K]` int64, each
    rank's `topk_idx`. The model simulates this routing, not one of its own: at batch 1 a
    rank's 8 rows split 5/3 or 4/4 between the ranks in the bench where the simulator's
    own draw (seed 0) splits them 5/3 and 1/7, a different call."""
    from ubep.bench.config import BenchConfig
    from ubep.bench.runner import bench_inputs

    cfg = BenchConfig(ranks=(RANKS,), hiddens=(hidden,), batches=(batch,), top_k=TOP_K,
                      experts=EXPERTS, systems=tuple(SYSTEMS), seed=seed)
    out = np.stack([bench_inputs(cfg, r, batch, hidden)[1].numpy() for r in range(RANKS)])
    out.setflags(write=False)
    return out


def remote_share(batch: int, hidden: int = HIDDEN, seed: int = 0) -> float:
    """Share of the ranks' (token, expert) rows whose expert lives on the other rank, in the
    bench's routing at this batch and hidden (`bench_topk`)."""
    topk = bench_topk(batch, hidden, seed)
    owner = topk // (EXPERTS // RANKS)
    return float((owner != np.arange(RANKS)[:, None, None]).mean())


def footprint_bytes(system: str, batch: int, hidden: int = HIDDEN,
                    top_k: int = TOP_K) -> int:
    """Bytes one rank's calls cycle through when the bench repeats dispatch+combine:
    where its rows are read from and written to.

    Uniform routing over 2 ranks: a rank sends `batch * top_k` rows and receives as many,
    `remote_share` of them through a window. One-worker path: its input, the dispatch
    window rows it receives from the peer (16-byte header + row as tff blocks) and the
    combine window rows, times `window_copies`, the received rows twice (the bench keeps a
    dispatch's result until the next dispatch returned, so two `recv_x` take turns) and the
    output. Direct: its input, its receive area (read in place by combine) with its meta
    words, and the output.
    """
    rb = hidden * BYTES_PER_ELEMENT
    rows = batch * top_k
    x, out = batch * rb, batch * rb
    if path_of(system) == "direct":
        return x + rows * (rb + 16) + out
    remote = round(rows * remote_share(batch, hidden))
    wins = window_copies() * remote * (record_wire_bytes(rb) + record_wire_bytes(rb, 0))
    return x + wins + 2 * rows * rb + out


@functools.cache
def window_copies() -> int:
    """Window sets a one-worker rank cycles through when dispatch and combine alternate,
    from the runtime's epoch rule (`region.next_epoch`: the parity a call's windows use);
    2 for a runtime that alternates parities every call (no such rule)."""
    try:
        from ubep.runtime.shm.region import next_epoch
    except ImportError:
        return 2
    e, parities = 0, set()
    for _ in range(4):                       # dispatch, combine, dispatch, ...
        e = next_epoch(e)
        parities.add(e % 2)
    return len(parities)


def host_topology():
    """Two ranks of this host, one worker each; stores are posted (the copy is the cost)."""
    from ubep.plan.topology import Tier, Topology

    return Topology(name="host", num_ranks=RANKS, workers_per_rank=1, atomic_block_bytes=512,
                    flag_bytes=8, tiers=(Tier("host", RANKS, 100.0, 10.0),),
                    local_latency_ns=100.0, local_bandwidth_GBps=10.0, staging_rows=64,
                    description="this host, for validate-host")


def host_params(flag_rtt_us: float, send_ns_per_byte: float = 0.0,
                recv_ns_per_byte: float = 0.0, *, row_bytes: int = HIDDEN * 2,
                launch_us: float = 0.0):
    """`CostParams` of the host model: a row costs its sender `send_ns_per_byte` and its
    receiver `recv_ns_per_byte` per payload byte (0: free); a store is visible half a flag
    round trip after it was written; nothing else costs (the receiver's flag checks are
    part of its measured pass; the rest is `launch_us`)."""
    from ubep.sim.fabric import wire_layout
    from ubep.sim.params import CostParams

    _, wire = wire_layout(row_bytes, "tff", 512, 8)     # the engine charges the wire bytes
    return CostParams(stage_bw_GBps=_bw(send_ns_per_byte * row_bytes / wire),
                      copy_bw_GBps=_bw(recv_ns_per_byte),
                      port_bw_scale=math.inf,
                      latency_scale=(flag_rtt_us / 2) / 0.1,   # topology hop: 100 ns
                      launch_us=launch_us, phase_fixed_us=0.0, barrier_us=0.0,
                      flag_issue_us=0.0, poll_us=0.0, scan_ns_per_entry=0.0,
                      count_ns_per_pair=0.0, cumsum_ns_per_entry=0.0, signal_us=0.0,
                      uplink_bw_scale=0.0, fence_us=0.0, detect_ns_per_block=0.0,
                      checksum_ns_per_block=0.0, rearm_ns_per_block=0.0)


def _bw(ns_per_byte: float) -> float:
    return math.inf if ns_per_byte <= 0 else 1.0 / ns_per_byte


def pass_ns_per_byte(system: str, op: str, side: str, batch: int, table: CopyTable,
                     footprint: float, hidden: int = HIDDEN, seed: int = 0) -> float:
    """ns per payload byte of a row on `side` ("send"/"recv") of `system`'s `op`: the path's
    passes priced at `footprint`, weighted by the share of rows each applies to (in the
    bench's routing at `batch` and `hidden`)."""
    share = remote_share(batch, hidden, seed)
    weight = {"remote": share, "local": 1.0 - share, "all": 1.0}
    return sum(weight[rows] * table.cost_ns_per_byte(p, footprint)
               for p, rows in ROW_PASSES[(path_of(system), op)][side])


def call_params(system: str, op: str, hidden: int, batch: int, table: CopyTable,
                flag_rtt_us: float, call_us: float = 0.0, faults: float = 0.0, seed: int = 0):
    """The host model's `CostParams` for one call: the row passes of `system`'s path priced
    at this call's footprint; `faults` fresh pages and `call_us` as its fixed part."""
    fp = footprint_bytes(system, batch, hidden)
    send, recv = (pass_ns_per_byte(system, op, side, batch, table, fp, hidden, seed)
                  for side in ("send", "recv"))
    # a table without first_touch (the validation's interleaved tables) prices them at 0, as
    # the CLI says
    timed = ("first_touch", 2) in table.ns_per_byte
    fixed = call_us + (faults * PAGE * table.cost_ns_per_byte("first_touch", faults * PAGE)
                       / 1e3 if faults and timed else 0.0)
    return host_params(flag_rtt_us, send, recv, row_bytes=hidden * BYTES_PER_ELEMENT,
                       launch_us=fixed)


def predict(system: str, op: str, hidden: int, batch: int, params, seed: int = 0) -> float:
    """The model's latency of one call (the slower rank), us, on the bench's routing
    (`bench_topk`)."""
    from ubep.sim.api import SimConfig, execute, prepare

    mode, direct = SYSTEMS[system]
    cfg = SimConfig(tokens_per_rank=batch, hidden=hidden, top_k=TOP_K, num_experts=EXPERTS,
                    bytes_per_element=BYTES_PER_ELEMENT, mode=mode, sync="tff",
                    schedule="static" if mode == "bsp" else "hierarchical", op=op,
                    direct=direct)
    prep = prepare(host_topology(), cfg, params=params, topk=bench_topk(batch, hidden, seed))
    return execute(prep, params).latency_us


def model_passes(faults: bool = False) -> tuple[str, ...]:
    """The passes the model prices rows with (`ROW_PASSES`; `first_touch` too if calls
    fault pages)."""
    used = {p for sides in ROW_PASSES.values() for passes in sides.values() for p, _ in passes}
    return tuple(sorted(used | ({"first_touch"} if faults else set())))


def model_footprints(batches=BATCHES) -> tuple[int, ...]:
    """Every footprint the validation prices a call of `batches` at (each system, hidden
    64 and 7168): the microbenchmark times exactly these."""
    return tuple(sorted({footprint_bytes(s, b, h) for s in SYSTEMS for b in batches
                         for h in (TINY_HIDDEN, HIDDEN)}))


def constants(med: dict, rtt: float, table: CopyTable, faults: dict | None = None,
              batches=BATCHES, seed: int = 0) -> HostConstants:
    """Per-call overheads from the hidden-64 points of the bench run: at each batch, what
    the call cost beyond the model's data movement for its 128-byte rows (never < 0).
    `faults`: pages faulted per call at hidden 7168 (`count_faults`; none if omitted);
    `seed`: the bench's routing seed (`bench_topk`)."""
    call = {}
    for system in SYSTEMS:
        for op in ("dispatch", "combine"):
            for b in batches:
                m = med.get((system, TINY_HIDDEN, b, op))
                if m is None:
                    continue
                p = call_params(system, op, TINY_HIDDEN, b, table, rtt, seed=seed)
                call[(system, op, b)] = max(0.0, m - predict(system, op, TINY_HIDDEN, b, p,
                                                             seed))
    return HostConstants(table=table, flag_rtt_us=rtt, call_us=call, faults=dict(faults or {}))


def validate(med: dict, hc: HostConstants, batches=BATCHES, seed: int = 0) -> list[dict]:
    """Predicted vs measured for every system, batch (of `batches`) and op at hidden 7168,
    on the bench's routing of `seed`."""
    rows = []
    for system in SYSTEMS:
        for batch in batches:
            for op in ("dispatch", "combine"):
                call = hc.call_us.get((system, op, batch), 0.0)
                faults = hc.faults.get((system, op, batch), 0.0)
                p = call_params(system, op, HIDDEN, batch, hc.table, hc.flag_rtt_us, call,
                                faults, seed)
                pred = predict(system, op, HIDDEN, batch, p, seed)
                meas = med.get((system, HIDDEN, batch, op))
                rows.append({"system": system, "batch": batch, "op": op,
                             "footprint_MB": footprint_bytes(system, batch) / 1e6,
                             "call_us": call, "faults": faults, "predicted_us": pred,
                             "measured_us": meas,
                             "error": (pred - meas) / meas if meas else float("nan")})
    return rows


def markdown_table(rows: list[dict]) -> str:
    """`validate`'s rows as markdown (`<bench-out>/validate_host.md`): one line per
    system and batch, dispatch and combine side by side (medians over the bench runs, and
    in brackets the range over the runs when there were several), and the count within
    +-25%."""
    by = {(r["system"], r["batch"], r["op"]): r for r in rows}
    err = "err, chunks kept" if all("chunks" in r for r in rows) else "err"
    lines = [f"| system | batch | footprint MB | faulted pages (d / c) | dispatch model / "
             f"measured ({err}) | combine model / measured ({err}) |",
             "|---|---|---|---|---|---|"]

    def rng(r: dict, what: str) -> str:
        lo, hi = r.get(f"{what}_lo_us"), r.get(f"{what}_hi_us")
        return f" [{lo:,.0f}-{hi:,.0f}]" if lo is not None and hi is not None and \
            round(lo) != round(hi) else ""

    def cell(r: dict) -> str:
        pairs = f", {r['kept']}/{r['chunks']}" if "chunks" in r else ""
        return (f"{r['predicted_us']:,.0f}{rng(r, 'predicted')} / "
                f"{r['measured_us']:,.0f}{rng(r, 'measured')} "
                f"({100 * r['error']:+.0f}%{pairs})")

    for system in SYSTEMS:
        for b in BATCHES:
            d, c = by[(system, b, "dispatch")], by[(system, b, "combine")]
            lines.append(f"| {system} | {b} | {d['footprint_MB']:.1f} | {d['faults']:.0f} / "
                         f"{c['faults']:.0f} | {cell(d)} | {cell(c)} |")
    ok = sum(abs(r["error"]) <= 0.25 for r in rows)
    return "\n".join(lines) + f"\n\nwithin ±25%: {ok} of {len(rows)}\n"


# -- measuring ------------------------------------------------------------------------------------
@contextmanager
def bench_lock(path: str = BENCH_LOCK):
    """Hold the host's benchmark lock (`flock`): at most one benchmark runs at a time."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fault_rank(rank: int, world: int, batches, calls: int) -> dict:
    """One rank of `count_faults`: every system's Buffer, each batch, systems in turns of
    `calls` calls as the bench runs them; minor faults around each call, per call."""
    import resource

    import torch

    import ubep
    from ubep.testing import make_routing, make_tokens

    def minflt() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    bufs = {s: ubep.Buffer(num_experts=EXPERTS, hidden=HIDDEN, max_tokens_per_rank=max(batches),
                           backend="shm", mode=SYSTEMS[s][0], max_top_k=TOP_K,
                           direct=SYSTEMS[s][1]) for s in SYSTEMS}
    out: dict = {}
    try:
        for b in batches:
            idx, w = make_routing(b, TOP_K, EXPERTS, seed=rank)
            x = make_tokens(rank, b, HIDDEN, torch.bfloat16)
            for turn in range(3):               # the first turn warms up, untimed
                for s, buf in bufs.items():
                    res = None
                    for _ in range(calls):
                        f0 = minflt()
                        res = buf.dispatch(x, idx, w)   # the previous result lives till here
                        f1 = minflt()
                        buf.combine(res.recv_x, res.handle)
                        f2 = minflt()
                        if turn:
                            out.setdefault((s, "dispatch", b), []).append(f1 - f0)
                            out.setdefault((s, "combine", b), []).append(f2 - f1)
    finally:
        for buf in bufs.values():
            buf.close()
    return {k: float(sum(v)) / len(v) for k, v in out.items()}


def count_faults(batches=BATCHES, calls: int = 20) -> dict:
    """Pages each system's calls fault at hidden 7168 (P=2, top-8), the mean per call, the
    larger of the two ranks: the runtime run in the bench's pattern (systems taking turns of
    `calls` calls, each call's result alive until the next dispatch replaces it). A count of
    the runtime's allocations meeting fresh memory, not a timing."""
    from ubep.testing import run_ranks

    per_rank = run_ranks(_fault_rank, RANKS, tuple(batches), calls)
    return {k: max(r[k] for r in per_rank) for k in per_rank[0]}
