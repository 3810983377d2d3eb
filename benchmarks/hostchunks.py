"""Host validation in interleaved chunks: the table a bench is predicted from and the bench
it predicts, timed within a second of each other, many times (`python -m benchmarks
validate-host`).

Why: this host switches between states ~3x apart every few seconds (the one-worker path's
cross-core records 0.4-0.6 or ~2.7 us per 14 KB row, in the microbenchmark and the bench
alike; docs/results/simulator.md). A table timed before a bench of ~4 s and the bench may
meet different states; then the prediction is right for the state the table saw and the
point misses. So both ranks of one process pair (`ubep.testing.run_ranks`, each bound to
its core as `ubep bench` binds them) alternate, per batch:

    table, bench chunk, table, bench chunk, ..., bench chunk, table      (`schedule`)

A table is the model's passes (`host.model_passes`) at exactly that batch's footprints
(`host.model_footprints`), each point timed once (~0.2-0.7 s), each exchange in the order
the bench's calls reach its buffers: the one-worker path's dispatch and combine windows
in turn, each parity's in turn (`hostbench.time_windows`: never one window twice in a row,
which at batch 1 costs ~1.8x per row), the direct path's write and read of one area back to
back (its dispatch then its combine), each exchange for the chunk's `warmup` untimed and
`iters` timed calls of one system (a round's cost falls with the rounds on the same memory
before it: `_time_table`); a bench chunk is every
shm system at hidden 64 and 7168, `iters` timed calls each after `warmup` untimed ones,
timed as `ubep bench` times them (`ubep.bench.runner`: a cross-process barrier before
each dispatch and each combine, the max over ranks per call; ~0.05-0.2 s), combine taking
recv_x itself (`ubep bench --expert identity`: the model's exchanges have no expert between
them). A table's
point is the slower of the two processes' costs (`table_of`: the cores are not equally
fast and every call waits on the slower). Each bench
chunk is predicted from the two tables around it (the mean of their predictions, the
per-call overhead from the chunk's own hidden-64 calls, each timed right after a hidden-7168
call, whose traffic evicts the caller's working set as it does for a hidden-7168 call:
`_time_cold`; their outputs lent as the hidden-7168 calls' are: `lend_as_at`), and its
paired error is
prediction / measured median - 1. A chunk whose two tables disagree by more than the
tolerance tested (`settled`) saw the host change state during it: which state its bench
met is not known, so its prediction is not determined to the tolerance and the chunk is
dropped (counted and reported). A point's error is the median of its kept chunks' errors.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks import host, hostbench
from ubep.bench.runner import gc_paused, timed_pair

#: bench chunks per batch per round; rounds per validation (the batches in turn each round)
CHUNKS, ROUNDS = 5, 3
#: timed calls per system and hidden in a bench chunk, after `WARMUP` untimed ones
ITERS, WARMUP = 10, 3
#: the tolerance validated: a chunk is paired only if its two tables agree within it
TOLERANCE = 0.25
HIDDENS = (host.TINY_HIDDEN, host.HIDDEN)
#: the exchange and cycled passes a table times (`hostbench`): those of `model_passes`
GROUPS = ("copy_fanout", "dispatch_peer", "combine_peer", "direct")


@dataclass(frozen=True)
class ChunkSpec:
    """What the ranks run: batches, rounds, chunks, calls per chunk, the exchange buffers."""

    batches: tuple[int, ...] = host.BATCHES
    rounds: int = ROUNDS
    chunks: int = CHUNKS
    iters: int = ITERS
    warmup: int = WARMUP
    seconds: float = 0.02               # per cycled table point (`hostbench.time_pass`)
    segments: tuple = ()                # ((path, size), ...) one per rank
    seed: int = 0

    def __post_init__(self):
        for name in ("rounds", "chunks", "iters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup={self.warmup!r} must be an int >= 0")
        if not self.batches or any(b not in host.BATCHES for b in self.batches):
            raise ValueError(f"batches={self.batches!r} must be a non-empty subset of "
                             f"{host.BATCHES}")


def schedule(batches, rounds: int, chunks: int) -> list[tuple[str, int, int, int]]:
    """The events in order: `(kind, batch, round, index)`, kind "table" or "bench". Each
    round takes the batches in turn; a batch's turn is `chunks` bench chunks with a table
    before each and one after the last, so bench chunk j sits between tables j and j + 1."""
    out = []
    for r in range(rounds):
        for b in batches:
            for j in range(chunks):
                out += [("table", b, r, j), ("bench", b, r, j)]
            out.append(("table", b, r, chunks))
    return out


def settled(before: float, after: float, tol: float = TOLERANCE) -> bool:
    """Whether the predictions of the tables before and after a chunk agree within `tol`
    (the larger at most `1 + tol` times the smaller): the host did not change state in
    between, as far as the model's passes show."""
    lo, hi = min(before, after), max(before, after)
    return lo > 0 and hi <= (1.0 + tol) * lo


def pair_point(chunks, tol: float = TOLERANCE) -> dict:
    """One point from its chunks `[(predicted from the table before, from the table after,
    measured median), ...]`: each chunk predicted as the mean of its two tables; the kept
    chunks are the `settled` ones (all of them if none is, flagged `unsettled`); over the
    kept: the median prediction and measurement with their ranges, and `error`, the median
    of the kept chunks' own errors (prediction / measured - 1)."""
    if not chunks:
        raise ValueError("chunks must not be empty")
    c = [(float(b), float(a), float(m)) for b, a, m in chunks]
    kept = [x for x in c if settled(x[0], x[1], tol)]
    unsettled = not kept
    use = kept or c
    pred = [(b + a) / 2 for b, a, _ in use]
    meas = [m for _, _, m in use]
    errs = [p / m - 1.0 for p, m in zip(pred, meas)]
    return {"predicted_us": float(np.median(pred)), "measured_us": float(np.median(meas)),
            "predicted_lo_us": min(pred), "predicted_hi_us": max(pred),
            "measured_lo_us": min(meas), "measured_hi_us": max(meas),
            "error": float(np.median(errs)), "chunk_errors": errs,
            "chunks": len(c), "kept": len(kept), "unsettled": unsettled}


# -- the ranks ---------------------------------------------------------------------------------
def _table_points(batch: int) -> list[tuple[str, int]]:
    return [(g, f) for g in GROUPS for f in host.model_footprints((batch,))]


def _time_table(batch: int, state: dict, rng: random.Random) -> dict:
    """Every (group, footprint) of `batch` timed once, in a shuffled order (the same on both
    ranks): `{group: {footprint: (ns/B,) or (write ns/B, read ns/B)}}`. The one-worker
    path's two exchanges at a footprint are timed together, as the bench's calls meet their
    windows (`hostbench.time_windows`); the direct exchange's write and read back to back,
    as the bench's direct dispatch and combine meet its one receive area.

    Each exchange runs as many rounds as a bench chunk runs calls of one system, and times
    the same ones: `warmup` untimed, then `iters` timed (`state`). Why: after other memory
    traffic the first rounds on a footprint cost more, and each further round of the same
    exchange less (the direct exchange at the batch-128 footprint: 1.7 us per row in the
    first round, ~0.8 after 12-15, the runtime's own calls alike side by side); a table that
    timed rounds 2-6 priced the bench's calls 4-13 (its median ~1.4x theirs)."""
    rb = host.HIDDEN * host.BYTES_PER_ELEMENT
    pts = _table_points(batch)
    rng.shuffle(pts)
    out: dict = {}
    spin, own, peer, me = state["spin"], state["own"], state["peer"], state["me"]
    setups, sec = state["setups"], state["seconds"]
    # an exchange's rounds as the bench chunk's calls of one system: `warmup` untimed, then
    # `iters` timed (the cost of a round falls with the rounds of it before: see above)
    warmup, iters = state["warmup"], state["iters"]
    for g, f in pts:
        key = (g, f)
        if g in hostbench.WINDOWS:
            if f in out.get(g, {}):
                continue                        # timed with the other window exchange
            wkey = ("windows", f)
            if wkey not in setups:
                setups[wkey] = hostbench.window_setups(f, rb, own, peer, me,
                                                       host.window_copies())
            e0 = state["epoch"]
            state["epoch"] += (warmup + iters) * len(hostbench.WINDOWS)
            ns = hostbench.time_windows(f, rb, own, peer, sec, spin, me, setup=setups[wkey],
                                        epoch0=e0, warmup=warmup, calls=iters)
            for x in hostbench.WINDOWS:
                out.setdefault(x, {})[f] = tuple(ns[p] for p in hostbench.EXCHANGES[x])
            continue
        if g in hostbench.EXCHANGES:
            if key not in setups:
                setups[key] = hostbench._exchange_setup(g, f, rb, own, peer, me)
            e0 = state["epoch"]
            state["epoch"] += warmup + iters
            v = hostbench.time_exchange(g, f, rb, own, peer, sec, spin, me,
                                        setup=setups[key], epoch0=e0, warmup=warmup,
                                        rounds=iters)
        else:
            if key not in setups:
                setups[key] = hostbench._setup(g, f, rb)
            v = (hostbench.time_pass(g, f, rb, sec, spin, setup=setups[key]),)
        out.setdefault(g, {})[f] = v
    return out


def _time_bench(systems: dict, sync, iters: int, warmup: int, rng: random.Random
                ) -> tuple[dict, dict]:
    """Every (hidden, system) of one batch: `warmup` untimed then `iters` timed calls back to
    back, in a shuffled order (the same on both ranks), timed as `ubep bench` times them:
    `{(system, hidden): [[dispatch us ...], [combine us ...]]}`, and the backend's phases
    of each timed call (`{(system, hidden): [{"<op>:<phase>": us}, ...]}`, read after it)."""
    order = sorted(systems)
    rng.shuffle(order)
    out, phases = {}, {}
    with gc_paused():
        for key in order:
            s = systems[key]
            t = np.empty((2, iters))
            for it in range(-warmup, iters):
                dc = timed_pair(sync, s)
                if it >= 0:
                    t[:, it] = dc
                    phases.setdefault((key[1], key[0]), []).append(s.phases())
            out[(key[1], key[0])] = t.tolist()
    return out, phases


def _time_cold(systems, sync, iters: int, warmup: int, rng: random.Random) -> dict:
    """The per-call overhead as a hidden-7168 call meets it: for each system, `warmup` untimed
    then `iters` timed hidden-64 calls, each right after an untimed hidden-7168 dispatch and
    combine of the same system and batch (timed as `_time_bench`): `{(system, 64): [[dispatch
    us ...], [combine us ...]]}`.

    Why: a hidden-64 call after a hidden-64 call finds its working set (interpreter, torch,
    the kernels' state) in cache; a hidden-7168 call finds it evicted by the megabytes the
    call before it moved. Measured side by side at batch 8 (P=2), a hidden-64 dispatch cost
    52-59 us after a hidden-64 call and 86-98 us after a hidden-7168 one (combine 40-48 vs
    49-60): a call's fixed part, taken from back-to-back hidden-64 calls, is the warm one.
    """
    names = sorted({n for _, n in systems})
    rng.shuffle(names)
    out = {}
    with gc_paused():
        for n in names:
            big, small = systems[(host.HIDDEN, n)], systems[(host.TINY_HIDDEN, n)]
            t = np.empty((2, iters))
            for it in range(-warmup, iters):
                timed_pair(sync, big)           # untimed: it only evicts
                dc = timed_pair(sync, small)
                if it >= 0:
                    t[:, it] = dc
            out[(n, host.TINY_HIDDEN)] = t.tolist()
    return out


def output_pool(system):
    """The `OutputPool` a bench system of the shm backend (`ubep.bench.systems.BufferSystem`)
    lends its `recv_x` and combine outputs from; an error naming `system` if it has none."""
    from ubep.runtime.shm.outputs import OutputPool

    pool = system
    for attr in ("buf", "_backend", "_path", "_lend"):
        pool = getattr(pool, attr, None)
    if not isinstance(pool, OutputPool):
        raise TypeError(f"system={system!r} must be a shm BufferSystem whose path lends its "
                        "outputs from an OutputPool")
    return pool


def lend_as_at(pool, hidden: int, like: int = host.HIDDEN) -> None:
    """Make `pool` (of a system at `hidden`) lend an output of r rows from its kept blocks
    exactly when the same pool at `like` would (its byte threshold scaled by `hidden /
    like`, rounded up): the per-call overhead's hidden-64 calls then allocate their outputs
    as the hidden-7168 calls they stand for do.

    Why: `OutputPool.empty` lends outputs of 256 KiB and more from its blocks (a numpy view,
    a weak reference, `torch.from_numpy`, a dtype view: Python) and leaves smaller ones to
    `torch.empty`. At batch 8 the hidden-7168 dispatch's `recv_x` (63 rows, 0.9 MB) takes
    the pool, the hidden-64 one's (8 KB) `torch.empty`; side by side in one process pair
    (hostval6) the pool's lending cost 38-41 us inside the hidden-7168 dispatch against
    8-9 us for `torch.empty` in the hidden-64 one, and the hidden-64 dispatch made to lend
    from the pool cost 114 us instead of 99 (median over calls of the max over ranks), a
    cost of the call's fixed part that the overhead missed at batches 8-128."""
    if hidden < 1 or like < 1:
        raise ValueError(f"hidden={hidden} and like={like} must be >= 1")
    pool.min_bytes = -(-pool.min_bytes * hidden // like)


def _open_segments(segments, me: int) -> dict:
    maps, bufs = hostbench.map_segments(segments)
    spin = hostbench.SpinBarrier(bufs[0].ctypes.data + bufs[0].nbytes - hostbench.PAGE, me,
                                 len(bufs))
    return {"maps": maps, "own": bufs[me], "peer": bufs[(me + 1) % len(bufs)], "spin": spin,
            "me": me, "setups": {}, "epoch": 2}


def chunk_rank(rank: int, world: int, spec: ChunkSpec) -> dict:
    """One rank of the interleaved validation (run by `ubep.testing.run_ranks`): bound to
    its core, every shm system of every batch built and checked against the oracle once
    (untimed), then the events of `schedule`, all ranks in step. Returns `{"tables":
    [...], "bench": [...], "t": [(start, end) s], "rtt_us": [start, end]}`."""
    import torch

    from ubep import reference
    from ubep.bench.config import BenchConfig
    from ubep.bench.flags import HostSync
    from ubep.bench.runner import bench_inputs, checked_call, pin_rank
    from ubep.bench.systems import make_system

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    pin_rank(rank, world)
    job = os.environ.get("UBEP_JOB_ID", f"c{os.getpid()}")
    sync = HostSync.create(rank, world, job, timeout_s=60.0)
    state = _open_segments(spec.segments, rank)
    state.update(seconds=spec.seconds, warmup=spec.warmup, iters=spec.iters)
    systems: dict = {}
    out: dict = {"tables": [], "bench": [], "phases": [], "cold": [], "t": [], "rtt_us": []}
    try:
        out["rtt_us"].append(sync.flag_round_trip_us())
        for b in spec.batches:
            # combine takes recv_x itself: the host model's exchanges (`hostbench`) are the
            # calls' own, with no expert between them (`BenchConfig.expert`)
            cfg = BenchConfig(ranks=(world,), hiddens=HIDDENS, batches=(b,),
                              top_k=host.TOP_K, experts=host.EXPERTS,
                              systems=tuple(host.SYSTEMS), iters=spec.iters,
                              warmup=spec.warmup, block=spec.iters, seed=spec.seed,
                              expert="identity")
            for h in HIDDENS:
                inputs = [bench_inputs(cfg, r, b, h) for r in range(world)]
                ref = reference.dispatch([i[0] for i in inputs], [i[1] for i in inputs],
                                         [i[2] for i in inputs], cfg.experts)[rank]
                x, idx, w = inputs[rank]
                for name in host.SYSTEMS:
                    s = systems[(b, h, name)] = make_system(name, cfg, h)
                    if h != host.HIDDEN:        # outputs lent as the hidden-7168 call's
                        lend_as_at(output_pool(s), h)
                    sync.barrier()
                    checked_call(s, x, idx, w, ref)
        rng = random.Random(spec.seed)
        for kind, b, _, _ in schedule(spec.batches, spec.rounds, spec.chunks):
            sync.barrier()
            t0 = time.monotonic()
            if kind == "table":
                tab = _time_table(b, state, rng)
                out["tables"].append({g: {str(f): v for f, v in d.items()}
                                      for g, d in tab.items()})
            else:
                mine = {(h, n): s for (bb, h, n), s in systems.items() if bb == b}
                got, ph = _time_bench(mine, sync, spec.iters, spec.warmup, rng)
                out["bench"].append({f"{n}:{h}": v for (n, h), v in got.items()})
                out["phases"].append({f"{n}:{h}": v for (n, h), v in ph.items()})
                cold = _time_cold(mine, sync, spec.iters, spec.warmup, rng)
                out["cold"].append({f"{n}:{h}": v for (n, h), v in cold.items()})
            out["t"].append((t0, time.monotonic()))
        out["rtt_us"].append(sync.flag_round_trip_us())
    finally:
        for s in systems.values():
            s.close()
        sync.close()
        state.pop("setups").clear()
        for m in state.pop("maps"):
            try:
                m.close()
            except BufferError:             # a view still alive; the process ends anyway
                pass
    return out


# -- the driver --------------------------------------------------------------------------------
def merge_ranks(spec: ChunkSpec, per_rank: list[dict]) -> dict:
    """The ranks' results as one record: per table event each rank's ns/B of each (pass,
    footprint), per bench event the max over ranks of each call (as `ubep bench`); events
    in `schedule` order with their kind, batch, round, index and rank 0's times."""
    events, ti, bi = [], 0, 0
    t0 = per_rank[0]["t"][0][0] if per_rank[0]["t"] else 0.0
    for i, (kind, b, r, j) in enumerate(schedule(spec.batches, spec.rounds, spec.chunks)):
        start, end = per_rank[0]["t"][i]
        ev = {"kind": kind, "batch": b, "round": r, "index": j,
              "t_s": [start - t0, end - t0]}
        if kind == "table":
            ns = {}
            for g, names in ((g, hostbench.EXCHANGES.get(g, (g,))) for g in GROUPS):
                for k, name in enumerate(names):
                    fps = sorted(per_rank[0]["tables"][ti][g], key=int)
                    ns[name] = {f: [float(pr["tables"][ti][g][f][k]) for pr in per_rank]
                                for f in fps}
            ev["ns_per_byte"] = ns
            ti += 1
        else:
            ev["us"] = {key: np.max(np.array([pr["bench"][bi][key] for pr in per_rank]),
                                    axis=0).tolist() for key in per_rank[0]["bench"][bi]}
            ev["phases_us"] = _phase_medians([pr["phases"][bi] for pr in per_rank]) \
                if "phases" in per_rank[0] else {}
            if per_rank[0].get("cold"):
                ev["cold_us"] = {key: np.max(np.array([pr["cold"][bi][key] for pr in per_rank]),
                                             axis=0).tolist() for key in per_rank[0]["cold"][bi]}
            bi += 1
        events.append(ev)
    rtts = [v for pr in per_rank[:1] for v in pr["rtt_us"] if v is not None]
    return {"spec": {k: v for k, v in asdict(spec).items() if k != "segments"},
            "rtt_us": min(rtts) if rtts else 0.0, "events": events}


def _phase_medians(ranks: list[dict]) -> dict:
    """`{system:hidden: {"<op>:<phase>": us}}`: each phase's max over ranks per call, the
    median over calls (as `ubep bench`'s phases.csv)."""
    out = {}
    for key, calls in ranks[0].items():
        names = sorted({p for c in calls for p in c})
        out[key] = {p: float(np.median([max(r[key][i].get(p, 0.0) for r in ranks)
                                        for i in range(len(calls))])) for p in names}
    return out


def run_chunks(out: Path, spec: ChunkSpec | None = None) -> dict:
    """Run `chunk_rank` on two ranks (the caller holds the bench lock) with a CPU watch;
    write and return the merged record (`out/chunks.json`)."""
    from benchmarks.cpuwatch import CpuWatch
    from ubep.testing import run_ranks

    spec = spec or ChunkSpec()
    size = hostbench.shared_bytes(host.model_footprints(spec.batches),
                                  host.HIDDEN * host.BYTES_PER_ELEMENT)
    segs = hostbench._segments(host.RANKS, size)
    try:
        spec = ChunkSpec(**{**asdict(spec), "segments": tuple(segs)})
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        t = time.monotonic()
        with CpuWatch() as watch:
            per_rank = run_ranks(chunk_rank, host.RANKS, spec, timeout_s=900.0)
        rec = merge_ranks(spec, per_rank)
    finally:
        for path, _ in segs:
            os.unlink(path)
    rec.update(load=load, wall_s=time.monotonic() - t, others=watch.result.to_dict(),
               others_text=watch.result.describe())
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunks.json").write_text(json.dumps(rec, indent=0))
    return rec


#: how a table combines its two processes' costs of a point (`table_of`)
STATS = {"max": max, "median": lambda v: float(np.median(v))}


def table_of(ev: dict, stat: str = "max") -> hostbench.CopyTable:
    """A table event's `CopyTable` (two ranks at once), each point the `stat` of the two
    processes' costs. "max" (the model's): the two cores are not equally fast (in an
    exchange one process's halves took 1.2-1.3 us per row, the other's 1.8-1.9, which one
    flipping between runs), and every call of the bench waits on the slower one: its
    sends are the rows the other rank waits for, and the bench takes the max over ranks;
    so the slower core's passes are a call's. "median": their mean (the earlier tables')."""
    ns = ev["ns_per_byte"]
    fps = tuple(sorted(int(f) for f in next(iter(ns.values()))))
    pick = STATS[stat]

    def one(v) -> float:
        return float(pick(v)) if isinstance(v, list) else float(v)

    return hostbench.CopyTable(row_bytes=host.HIDDEN * host.BYTES_PER_ELEMENT,
                               footprints=fps,
                               ns_per_byte={(p, 2): tuple(one(v[str(f)]) for f in fps)
                                            for p, v in ns.items()})


#: where the per-call overhead comes from (`_medians`): "cold", hidden-64 calls each right
#: after a hidden-7168 call (`_time_cold`, the model's); "warm", the bench's back-to-back ones
OVERHEADS = ("cold", "warm")


def _medians(ev: dict, batch: int, overhead: str = "cold") -> dict:
    """A bench event's `{(system, hidden, batch, op): median us}`; `overhead` "cold": the
    hidden-64 points are the event's `_time_cold` calls (when it has them)."""
    if overhead not in OVERHEADS:
        raise ValueError(f"overhead={overhead!r} must be one of {OVERHEADS}")
    med = {}
    series = dict(ev["us"])
    if overhead == "cold":
        series.update(ev.get("cold_us", {}))
    for key, t in series.items():
        system, hidden = key.rsplit(":", 1)
        for i, op in enumerate(("dispatch", "combine")):
            med[(system, int(hidden), batch, op)] = float(np.median(t[i]))
    return med


def chunk_predictions(rec: dict, faults: dict | None = None, stat: str = "max",
                      overhead: str = "cold") -> dict:
    """`{(system, batch, op): [(predicted from the table before, after, measured, per-call
    us), ...]}`: every bench chunk predicted from each of its two tables (`host.validate`,
    per-call overhead from the chunk's own hidden-64 medians; the last element is the mean
    of the two tables')."""
    evs = rec["events"]
    seed = int(rec["spec"].get("seed", 0))
    tables = {(e["batch"], e["round"], e["index"]): table_of(e, stat) for e in evs
              if e["kind"] == "table"}
    out: dict = {}
    for e in evs:
        if e["kind"] != "bench":
            continue
        b, r, j = e["batch"], e["round"], e["index"]
        med = _medians(e, b, overhead)
        sides = []
        for tab in (tables[(b, r, j)], tables[(b, r, j + 1)]):
            hc = host.constants(med, rec["rtt_us"], tab, faults, batches=(b,), seed=seed)
            sides.append(host.validate(med, hc, batches=(b,), seed=seed))
        for before, after in zip(*sides):
            out.setdefault((before["system"], b, before["op"]), []).append(
                (before["predicted_us"], after["predicted_us"], before["measured_us"],
                 (before["call_us"] + after["call_us"]) / 2))
    return out


def validate_chunks(rec: dict, faults: dict | None = None, tol: float = TOLERANCE,
                    stat: str = "max", overhead: str = "cold") -> list[dict]:
    """`host.validate`'s rows for the interleaved run `rec`: per point `pair_point` of its
    chunks (with `chunks`, `kept`, ranges and the chunks' errors); tables by `stat`."""
    per = chunk_predictions(rec, faults, stat, overhead)
    faults = faults or {}
    rows = []
    for system in host.SYSTEMS:
        for b in rec["spec"]["batches"]:
            for op in ("dispatch", "combine"):
                row = {"system": system, "batch": b, "op": op,
                       "footprint_MB": host.footprint_bytes(system, b) / 1e6,
                       "faults": faults.get((system, op, b), 0.0),
                       "call_us": float(np.median([c[3] for c in per[(system, b, op)]]))}
                row.update(pair_point([c[:3] for c in per[(system, b, op)]], tol))
                rows.append(row)
    return rows


def states(rec: dict) -> dict:
    """What the tables saw of the host's state, per batch: us per 14 KB row of the
    one-worker dispatch's cross-core write (`record_write_fanout_peer`) at the batch's
    hidden-7168 one-worker footprint, and of the direct dispatch (`copy_scatter`) at its
    own, per table in time order each process's value."""
    rb = host.HIDDEN * host.BYTES_PER_ELEMENT
    out: dict = {}
    for e in rec["events"]:
        if e["kind"] != "table":
            continue
        b = e["batch"]
        for name, system in (("record_write_fanout_peer", "shm-ubep"),
                             ("copy_scatter", "shm-direct")):
            f = str(host.footprint_bytes(system, b))
            v = e["ns_per_byte"][name][f]
            out.setdefault(b, {}).setdefault(name, []).append(
                [x * rb / 1e3 for x in (v if isinstance(v, list) else [v])])
    return out
