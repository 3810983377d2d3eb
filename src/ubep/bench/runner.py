"""What each benchmark rank runs: every system, interleaved, on the same routing.

For every (hidden, batch) the rank builds its inputs (the same ones for every system),
checks one dispatch of every system against the oracle (untimed), then runs
`warmup + iters` iterations; in each, every system (in an order shuffled per iteration,
so drift hits all alike) does one dispatch and one combine, each started right after a
tight cross-process barrier (`HostSync`), with Python's cyclic GC paused. Each rank
returns its own times; the caller takes the max over ranks per iteration.

Two launchers share `bench_rank`: `ubep.testing.run_ranks` (gloo group; no MPI) and
`mpiexec` (`python -m ubep.bench.runner CONFIG OUT`), which adds the MPI peer.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import random
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from ubep import reference
from ubep.bench.config import AGRS_RAW, BOUND, MPI_RAW, RAW, BenchConfig
from ubep.bench.flags import HostSync
from ubep.bench.systems import make_system
from ubep.quant import per_token_cast_to_fp8
from ubep.testing import make_routing, make_tokens


def bench_inputs(cfg: BenchConfig, rank: int, batch: int, hidden: int):
    """Rank `rank`'s `(x, topk_idx, topk_weights)` at one point of `cfg`: the same on every
    rank that builds them (each rank builds every rank's, for the oracle) and in every run of
    the same seed. With `cfg.fp8`, `x` is `(x_fp8, x_scales)` (`ubep.quant`)."""
    seed = cfg.seed * 1_000_003 + batch * 131 + hidden
    idx, w = make_routing(batch, cfg.top_k, cfg.experts, kind=cfg.routing,
                          seed=seed * 17 + rank)
    x = make_tokens(rank, batch, hidden, cfg.torch_dtype, seed=seed)
    if cfg.fp8:
        x = per_token_cast_to_fp8(x)
    return x, idx, w


def oracle_rows(x) -> torch.Tensor:
    """The rows the oracle moves for input `x`: `x` itself, or for `(x_fp8, x_scales)` each
    row's fp8 bytes followed by its scales' bytes (uint8), so one `ubep.reference.dispatch`
    places both (`systems.check_dispatch` splits them again)."""
    if isinstance(x, tuple):
        rows, scales = x
        return torch.cat([rows.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return x


def _agree(ok: bool, reason: str | None) -> str | None:
    """Collective: None if every rank is ok, else the first rank's reason."""
    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if ok else (reason or "failed"))
    bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


def _try(fn, *args) -> tuple[object, str | None]:
    try:
        return fn(*args), None
    except NotImplementedError as e:
        return None, f"not built: {e}"
    except Exception as e:  # noqa: BLE001 - reported as the system's failure, not hidden
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:300]


def bench_rank(rank: int, world: int, cfg: BenchConfig, comm=None, probe=None) -> dict:
    """Run the benchmark on this rank. Collective over the default process group.

    `probe`, if given, is called on every rank around the timed points: `probe.start(sync)`
    before the first, `probe.end(sync)` after the last (`sync`: this run's `HostSync`), and
    `probe.result()` goes back as "probe" (the lab's host probes in benchmarks/ use it).

    Returns `{"times": {(system, hidden, batch): array [2, iters] µs (dispatch, combine)},
    "leads": {(system, hidden, batch): array [turns] µs}` (each turn's untimed first call,
    dispatch+combine; empty when `block` is 1),
    "phases": {(system, hidden, batch): [per iteration {"<op>:<phase>": µs}]} (Buffer systems),
    "bytes": {(hidden, batch): (dispatch_bytes, combine_bytes)}, "unavailable": {system:
    reason}, "rtt_us": float | None, "cpu": [cores this rank is bound to] | None,
    "xcopy": (bytes, peer-written µs, own-cache µs) | None}` (`HostSync.cross_core_copy_us`
    of the copy bound's dispatch bytes at the smallest batch and widest row),
    "spans": {(system, hidden, batch): array [4, iters] int64 ns}` (each timed iteration's
    dispatch start and end, combine start and end, `time.perf_counter_ns`), "probe": what
    `probe.result()` returned, or None.
    """
    # one core per rank: torch's own intra-op threads would compete with the ranks
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    pinned = pin_rank(rank, world) if cfg.pin else None
    job = os.environ.get("UBEP_JOB_ID", f"b{os.getpid()}")
    xbytes = (min(cfg.batches) * cfg.top_k * max(cfg.hiddens)
              * torch.empty(0, dtype=cfg.torch_dtype).element_size())
    sync = HostSync.create(rank, world, job, timeout_s=max(cfg.timeout_s, 10.0),
                           copy_bytes=xbytes)
    out: dict = {"times": {}, "leads": {}, "phases": {}, "bytes": {}, "unavailable": {},
                 "rtt_us": None, "cpu": pinned, "xcopy": None, "spans": {}, "probe": None}
    try:
        out["rtt_us"] = sync.flag_round_trip_us()
        xcopy = sync.cross_core_copy_us(xbytes)
        out["xcopy"] = None if xcopy is None else (xbytes, *xcopy)
        if probe is not None:
            probe.start(sync)
        # (the torch backend's raw collectives replay one Buffer call's: not fp8's two)
        names = [*cfg.systems, BOUND, *([RAW] if "torch" in cfg.systems and not cfg.fp8
                                        else []),
                 *([AGRS_RAW] if "agrs" in cfg.systems else []),
                 *([MPI_RAW] if "mpi" in cfg.systems else [])]
        for hidden in cfg.hiddens:
            systems = {}
            for name in names:
                if name in out["unavailable"]:
                    continue
                sysobj, why = _try(make_system, name, cfg, hidden, comm)
                why = _agree(why is None, why)
                if why is None:
                    systems[name] = sysobj
                else:
                    if sysobj is not None:
                        sysobj.close()
                    out["unavailable"][name] = why
            try:
                _bench_hidden(rank, world, cfg, hidden, systems, sync, out)
            finally:
                for s in systems.values():
                    s.close()
        out["rtt_us_end"] = sync.flag_round_trip_us()
        if probe is not None:
            probe.end(sync)
            out["probe"] = probe.result()
    finally:
        sync.close()
    return out


def pin_rank(rank: int, world: int) -> list[int] | None:
    """Bind this thread to the `rank`-th of `world` equal slices of the usable cores; its cores.

    Unbound, two ranks that slept (in a gloo collective, say) can be woken onto the same core
    and share it until the load balancer's next pass, milliseconds later: a whole turn of
    shm calls then runs 3-5x slower, each rank's spin-wait yielding to the other
    (measured on this project's 2-core VM). Threads started later inherit the binding;
    those already running (gloo's, started with the process group) stay free: bound with
    the rank to its one core, every gloo collective stalled for a scheduler tick (~4 ms).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if world > len(cpus):
        return None
    mine = cpus[rank * len(cpus) // world:(rank + 1) * len(cpus) // world]
    os.sched_setaffinity(0, mine)
    return mine


def checked_call(s, x, idx, w, ref) -> None:
    """One untimed dispatch (compared with the oracle) and combine of system `s`."""
    s.prepare(x, idx, w, ref)
    s.dispatch()
    bad = s.check(ref)
    _expert(s)
    s.combine()
    if bad:
        raise ValueError(bad)


def _bench_hidden(rank, world, cfg, hidden, systems, sync, out) -> None:
    for batch in cfg.batches:
        inputs = [bench_inputs(cfg, r, batch, hidden) for r in range(world)]
        ref = reference.dispatch([oracle_rows(i[0]) for i in inputs], [i[1] for i in inputs],
                                 [i[2] for i in inputs], cfg.experts)[rank]
        x, idx, w = inputs[rank]
        # one checked, untimed call per system; a system that fails or errs is dropped
        for name in list(systems):
            sync.barrier()
            _, why = _try(checked_call, systems[name], x, idx, w, ref)
            why = _agree(why is None, why)
            if why is not None:
                out["unavailable"][name] = f"at hidden={hidden} batch={batch}: {why}"
                systems.pop(name).close()
        if BOUND in systems:
            b = systems[BOUND]
            out["bytes"][(hidden, batch)] = (b.dispatch_bytes, b.combine_bytes)
        order = list(systems.values())
        times = {s.name: np.empty((2, cfg.iters)) for s in order}
        spans = {s.name: np.empty((4, cfg.iters), dtype=np.int64) for s in order}
        phases = {s.name: [] for s in order if hasattr(s, "phases")}
        leads = {s.name: [] for s in order}
        with gc_paused():
            _timed_loop(cfg, order, sync, times, phases, leads, spans)
        for name, t in times.items():
            out["times"][(name, hidden, batch)] = t
            out["spans"][(name, hidden, batch)] = spans[name]
            out["leads"][(name, hidden, batch)] = np.asarray(leads[name], dtype=float)
        for name, per_iter in phases.items():
            out["phases"][(name, hidden, batch)] = per_iter


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic GC collected once, then off for the block: a collection inside a
    timed call would land on one system at random. The harness's timed loops run in it
    (and the lab's host validation in benchmarks/)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _expert(system) -> None:
    """The system's stand-in expert between dispatch and combine, if it has one (untimed)."""
    step = getattr(system, "expert", None)
    if step is not None:
        step()


def timed_pair(sync, system, at: np.ndarray | None = None) -> tuple[float, float]:
    """One dispatch and one combine of `system`, each started right after a barrier of every
    rank (`HostSync`), the stand-in expert between them untimed: (dispatch µs, combine µs)
    on this rank. The harness's one way to time a call (the lab's host validation in
    benchmarks/ times with it too, so what it predicts is timed as `ubep bench` times it).
    `at` (4 int64), if given, receives the four clock readings (`time.perf_counter_ns`:
    dispatch start, end, combine start, end)."""
    perf = time.perf_counter_ns
    sync.barrier()
    t0 = perf()
    system.dispatch()
    t1 = perf()
    _expert(system)
    sync.barrier()
    t2 = perf()
    system.combine()
    t3 = perf()
    if at is not None:
        at[:] = (t0, t1, t2, t3)
    return (t1 - t0) / 1e3, (t3 - t2) / 1e3


def _timed_loop(cfg, order, sync, times, phases, leads, spans=None) -> None:
    """`warmup` untimed iterations of every system, then `iters` timed ones, in blocks.

    In each round every system runs `cfg.block` iterations back to back (the way a decode
    loop calls one layer's dispatch again and again), the systems in a seeded shuffled order,
    the same on every rank (they must call the same system together); drift between rounds
    hits every system alike. A fixed rotation would give every system the same predecessor
    every round, a bias that does not average out. `block=1` interleaves every iteration:
    then each call starts with the caches (and, on a VM, the core) that the previous system
    left, which costs a short call more than it costs a long one.

    With `block` > 1 each turn starts with one more call, its lead, kept out of `times`
    (into `leads`, dispatch+combine µs): it follows another system's turn, the cold call
    that `block=1` times every iteration, so in `times` every call follows a call of the
    same system, and a p99 there is the back-to-back calls' own, not one call in `block`
    that is cold by construction. `spans[name][:, i]`, if given, receives iteration i's clock
    readings (`timed_pair`'s `at`).
    """
    rng = random.Random(cfg.seed * 7919 + len(order))
    done = {s.name: -cfg.warmup for s in order}     # < 0: warm-up iterations still to run
    while any(v < cfg.iters for v in done.values()):
        shuffled = [s for s in order if done[s.name] < cfg.iters]
        rng.shuffle(shuffled)
        for s in shuffled:
            warming = done[s.name] < 0
            n = -done[s.name] if warming else cfg.block
            if not warming and cfg.block > 1:
                leads[s.name].append(sum(timed_pair(sync, s)))
            at = np.empty(4, dtype=np.int64)
            for _ in range(min(n, cfg.iters - done[s.name])):
                dc = timed_pair(sync, s, at)
                it = done[s.name]
                done[s.name] += 1
                if it >= 0:
                    times[s.name][:, it] = dc
                    if spans is not None:
                        spans[s.name][:, it] = at
                    if s.name in phases:  # after the timed region
                        phases[s.name].append(s.phases())


# -- the mpiexec launcher ---------------------------------------------------------------------

def _mpi_main(config_path: str, out_path: str) -> int:
    """Under mpiexec: join a gloo group through a TCP store, run `bench_rank`, gather."""
    from datetime import timedelta

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    with open(config_path, "rb") as f:
        cfg, probe = pickle.load(f)
    timeout = timedelta(seconds=max(cfg.timeout_s, 30.0))
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timeout) if rank == 0 else None
    port = comm.bcast(store.port if rank == 0 else None, root=0)
    if rank:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        result = ("ok", bench_rank(rank, world, cfg, comm, probe))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the launcher
        result = ("exception", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
    results = comm.gather(result, root=0)
    dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(_mpi_main(sys.argv[1], sys.argv[2]))
