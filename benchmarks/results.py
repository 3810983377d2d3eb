"""`python -m benchmarks results`: regenerate docs/results.md from two runs of the peer bench,
in one command.

Run 1 lets every system take turns of `--block 20` back-to-back iterations (how a decode
loop calls one layer again and again); run 2 interleaves every iteration (`--block 1`: each
call starts on caches another system evicted). Every figure written is a median or a ratio
of medians of one run, with the bounds measured in the same run beside each system: the
copy bound (the bytes each rank must move, memcpy'd once, plus a flag round trip) and the
torch backend's raw collectives (its `all_to_all_single` calls, bare, same bytes).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks.probes import HostProbes, HostRecord, host_record
from ubep.bench.cli import PEERS_BATCHES, PEERS_HIDDENS
from ubep.bench.config import BOUND, BenchConfig
from ubep.bench.run import BenchResult, mpi_unavailable_reason, run_bench

SYSTEMS = ("shm-owned", "shm-ubep", "shm-direct", "shm-bsp", "torch", "mpi", "agrs")
#: the hidden size the headline figures are read at (DeepSeek-V3's)
HEADLINE_HIDDEN = 7168
#: timed iterations per point: a p99 over 200 is (about) the 3rd slowest call, over 100 it was
#: the 2nd: two calls the host took a core from set it
ITERS = 200
#: the shm paths each target figure is read for (the default first)
_SHM_SYSTEMS = ("shm-owned", "shm-direct", "shm-ubep")
#: the paths that stage rows through windows (the paper's two copies per row)
_STAGED = ("shm-ubep", "shm-bsp")


def configs(iters: int, warmup: int) -> tuple[BenchConfig, BenchConfig]:
    """(turns of 20 at both hidden sizes, interleaved every iteration at 7168)."""
    systems = SYSTEMS if mpi_unavailable_reason() is None else \
        tuple(s for s in SYSTEMS if s != "mpi")
    common = dict(ranks=(2,), batches=PEERS_BATCHES, top_k=8, experts=16, dtype="bfloat16",
                  systems=systems, iters=iters, warmup=warmup)
    return (BenchConfig(hiddens=PEERS_HIDDENS, block=20, **common),
            BenchConfig(hiddens=(HEADLINE_HIDDEN,), block=1, **common))


def _index(res: BenchResult) -> dict:
    return {(r["system"], r["hidden"], r["batch"], r["op"]): r for r in res.rows}


def _fmt_x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _ratio(ix: dict, a: str, b: str, hidden: int, batch: int) -> float | None:
    ra, rb = ix.get((a, hidden, batch, "total")), ix.get((b, hidden, batch, "total"))
    return None if ra is None or rb is None else ra["median_us"] / rb["median_us"]


def figures(turns: BenchResult, inter: BenchResult) -> list[str]:
    """The issue targets as one table: each figure from run 1 (turns) and run 2 (interleaved)."""
    h = HEADLINE_HIDDEN
    runs = (_index(turns), _index(inter))
    lines = ["| figure | target | turns of 20 | interleaved | reached |", "|---|---|---|---|---|"]

    def add(name: str, target: str, vals: tuple, ok) -> None:
        """`ok`: a test per run (turns, interleaved), one for both, or None (no target)."""
        oks = ok if isinstance(ok, tuple) else (ok, ok)
        got = [f(v) for f, v in zip(oks, vals) if v is not None and f is not None]
        reached = "-" if not got else ("yes" if all(got) else "no" if not any(got)
                                       else "partly")
        cells = [v if isinstance(v, str) else _fmt_x(v) for v in vals]
        lines.append(f"| {name} | {target} | {cells[0]} | {cells[1]} | {reached} |")

    for b in (1, 128):
        add(f"torch / (raw collectives + copy bound), batch {b}", "≤ 1.5×",
            tuple(ix.get(("torch", h, b, "total"), {}).get("x_raw_copy") for ix in runs),
            lambda v: v <= 1.5)
    for peer in ("mpi", "agrs"):
        for b in (1, 128):
            add(f"{peer} / (its collectives + copy bound), batch {b} (how far the peer is "
                "from its own floor)", "(competence)",
                tuple(ix.get((peer, h, b, "total"), {}).get("x_raw_copy") for ix in runs),
                None)
    bound = [ix.get((BOUND, h, 1, "total"), {}) for ix in runs]
    add("copy bound batch 1 p99 / median (the host's own tail for the same bytes)", "(floor)",
        tuple(None if not r else r["p99_us"] / r["median_us"] for r in bound), None)
    add("batch-1 dispatch bytes copied as the other core just wrote them / from the copying "
        "core's cache (what crossing cores adds to the copy bound)", "(floor)",
        tuple(None if 2 not in r.xcopy else r.xcopy[2][1] / r.xcopy[2][2]
              for r in (turns, inter)), None)
    for system in _SHM_SYSTEMS:
        med = tuple(ix.get((system, h, 1, "total"), {}).get("median_us") for ix in runs)
        p99 = tuple(ix.get((system, h, 1, "total"), {}).get("p99_us") for ix in runs)
        add(f"{system} dispatch+combine, batch 1, median", "≤ 40 µs (≤ 80 µs interleaved)",
            tuple(None if m is None else f"{m:.1f} µs" for m in med),
            (lambda v: float(v.split()[0]) <= 40, lambda v: float(v.split()[0]) <= 80))
        xb = tuple(ix.get((system, h, 1, "total"), {}).get("x_bound") for ix in runs)
        add(f"{system} batch 1 / copy bound", "≤ 6×", xb, lambda v: v <= 6)
        tails = tuple(None if m is None or p is None else p / m for m, p in zip(med, p99))
        add(f"{system} batch 1 p99 / median", "≤ 3× (≤ 6× interleaved)", tails,
            (lambda v: v <= 3, lambda v: v <= 6))
        floor = tuple(ix.get((system, h, 1, "total"), {}).get("host_p99x") for ix in runs)
        add(f"{system} batch 1 p99 / median the host's gaps alone give a call of this median "
            "(replayed over the run's gap probes; the floor under the line above: \"The "
            "host's own gaps\")", "(host floor)", floor, None)
        clear = [ix.get((system, h, 1, "total"), {}) for ix in runs]
        add(f"{system} batch 1 p99 / median of the calls that ran clear of the host's timer "
            "windows (the host's tail apart from the code's; \"The host's own gaps\")",
            "(host)", tuple(None if r.get("clear_p99_us") is None else
                            f"{r['clear_p99_us'] / r['clear_median_us']:.2f}× "
                            f"({100 * r['clear_share']:.0f}% of calls)" for r in clear), None)
        lead = turns.leads.get((system, 2, h, 1))
        add(f"{system} batch 1, a turn's untimed first call (after another system's turn), "
            "median / the timed calls' median", "(cold call)",
            (None if lead is None or med[0] is None else float(np.median(lead)) / med[0],
             None), None)
    for peer in ("torch", "mpi", "agrs"):
        for system in _SHM_SYSTEMS:
            for b in (1, 16, 128):
                add(f"{peer} / {system}, batch {b}", "(speed-up)",
                    tuple(_ratio(ix, peer, system, h, b) for ix in runs), lambda v: v > 1)
    for system in _SHM_SYSTEMS:
        # the staged path copies each row twice on its rank's core (into the window, out of
        # it): two copy bounds' work, "Two copies per row" below; no one-copy target for it
        staged = system in _STAGED
        add(f"{system} / copy bound, batch 128" + (" (two copies per row)" if staged else ""),
            "(≈ 2×, two copies)" if staged else "≤ 1.5×",
            tuple(ix.get((system, h, 128, "total"), {}).get("x_bound") for ix in runs),
            None if staged else lambda v: v <= 1.5)
    return lines


_SYSTEM_ROWS = (
    ('`shm-owned`',
     '`ubep.Buffer(backend="shm", direct="owned")` (what `backend="auto"` gives on one '
     'host): counts first, each row copied once into a receive area lent as `recv_x` while '
     'the caller holds it; results the caller owns, any handle combinable'),
    ('`shm-ubep`',
     '`ubep.Buffer(backend="shm", mode="ubep")`: the paper\'s mechanism on shared memory: '
     'kernel decomposition, TFF epochs, rows via windows (two copies per row)'),
    ('`shm-direct`',
     '`ubep.Buffer(backend="shm", direct=True)`: counts first, each row copied once to its '
     'final place, per-row flag word; combine reads expert outputs in place; `recv_x` is '
     'valid until the next dispatch'),
    ('`shm-bsp`',
     '`ubep.Buffer(backend="shm", mode="bsp")`: the paper\'s barrier-separated baseline on '
     'the same runtime'),
    ('`torch`',
     '`ubep.Buffer(backend="torch")` (what `backend="auto"` gives across hosts): two or '
     'three `all_to_all_single` over gloo'),
    ('raw collectives',
     "the torch backend's `all_to_all_single` calls alone, on preallocated buffers, "
     'with the byte counts it sent to and received from each peer in this run '
     '(`Stats.extra["collectives"]`): at batch 1 one per dispatch (counts, routing and rows '
     'in one block per peer) and one per combine; called synchronously, where the backend '
     'starts them async and prepares what needs nothing from the peers before it waits'),
    ('agrs collectives',
     "the AgRs peer's all-gather (every rank's packed rows and routing) and reduce-scatter "
     '(the partial sums in the rows\' dtype) alone, on preallocated buffers of the sizes it '
     'moves, called as it calls them; its `× raw+copy` and the AgRs row\'s are taken '
     'against this line, not the torch backend\'s'),
    ('mpi collectives',
     "the MPI peer's `Alltoall` of counts, two `Ialltoallv` (rows; token, slot, weight) and "
     "the combine's `Alltoallv` alone, on preallocated buffers of its last dispatch's sizes; "
     "`mpi`'s `× raw+copy` is taken against this line"),
    ('`mpi`',
     '`ubep.bench.mpi_peer`: `MPI_Alltoall` counts, two concurrent `MPI_Ialltoallv` (rows; '
     'token, slot, weight), numpy reordering (MPICH wheel, `mpiexec`)'),
    ('`agrs`',
     "`ubep.bench.agrs_peer`: vLLM's CPU expert parallelism (`AgRsAll2AllManager`): one "
     "all-gather of every rank's rows and routing, this rank's experts' rows laid out, "
     "each gathered token's local rows summed in one compiled pass (fp32, as a fused MoE "
     "kernel's epilogue would), the partial sums reduce-scattered in bf16 (gloo)"),
    ('copy bound',
     'the bytes dispatch and combine must move on each rank (every routed row once each '
     "way), memcpy'd contiguously between page-aligned buffers by one core per rank at the "
     'same time, plus one flag round trip between the processes'),
)
_MEASURED = "| system | what it is |\n|:---|:---|\n" + "".join(
    f"| {name} | {text} |\n" for name, text in _SYSTEM_ROWS) + """
Every system's first dispatch at every point is compared byte for byte with `ubep.reference`
(untimed); a system that differs is dropped from the run and listed as unavailable. Each
timed call starts right after a shared-memory barrier; an iteration's time is the max over
ranks; warm-up iterations are excluded; Python's cyclic GC is paused in the timed loop.
Between dispatch and combine (untimed) the stand-in expert clones recv_x, and combine takes
the clone, weighted: an expert GEMM reads every received row and writes a new tensor, and
DeepEP's tests combine `simulated_gemm_x = packed_recv_x.clone()` the same way. Until
2026-12-03 combine took recv_x itself (`ubep bench --expert identity`); on one host that
flatters the one-copy paths: no core but the sender's ever reads a row, so neither the
next dispatch's writes nor combine's reads cross cores (in-process A/B, 2 ranks, batch 1,
`benchmarks/scripts/bench_shm_expert.py`: "The stand-in expert" above).
"""


_LIMITS = """\
*Two copies per row (shm-ubep, shm-bsp).* The paper's mechanism writes each row into a window
at its destination and then into the expert-major output, and combine copies back and then
reduces. With one core a rank, as here, that core makes both copies one after the other, so at
batch 128 these paths take up to two copy bounds (shm-ubep 1.56× in the run of 07:32 UTC on
2026-12-03, 2.02× in `ubep bench --tokens 128` at 09:33 with the host in its slow state,
shm-bsp 2.05× beside it); the paper spreads them over a die's cores. shm-direct exchanges the
per-expert counts first, so every row has a known final
place and is copied once; combine reads each expert output where it lies. Its price is
DeepEP low-latency semantics (`recv_x` valid until the next dispatch), which is why
`backend="auto"` does not turn it on. shm-owned is the same one-copy exchange into receive
areas lent as `recv_x` only while nothing else holds them (else copied out), so results are
the caller's and any handle combines: what `backend="auto"` runs on one host.

*Against the copy bound at batch 128.* Until 2026-12-03, when combine took recv_x itself,
shm-direct and shm-owned took less than the copy bound there (0.5-0.9x): the bound copies
every received row back for combine (a read and a write of each row, as a transport between
address spaces must), while these read each expert output where it lies, in the receive area
the sender wrote, and write only each token's sum; and the bound's one 14.7 MB memcpy per
rank takes glibc's non-temporal path, which copied the same bytes 10-20% slower than
row-size pieces (one process, AMD EPYC VM, 2026-12-02). With the cloned expert output the
bench now combines (a private tensor), combine first copies the rows peers read into shared
memory, as a real expert's output needs: 1.15-1.2x in the run of 10:09 UTC that day. A model
that writes its expert outputs into `get_combine_buffer`'s tensor skips that copy.

*How a row is written.* A loop of ordinary stores first reads every cache line it
overwrites (from memory, or from the core that last wrote it); memcpy's string stores write
whole lines without reading them, and the copy bound is a memcpy. shm-direct and shm-owned
copy rows by memcpy too: each row is guarded by a separate meta word stored after an `sfence`
(docs/sync.md). shm-ubep and shm-bsp copy window blocks with their own loops, since a
block's marker can be its own last word, which a string copy may store before the rest.
Combine sums a token's rows four at a time, one pass over its fp32 accumulator per four rows,
in the same order (same bits). Measured side by side with the previous version, alternated
(2026-12-01, Intel VM): shm-owned/copy bound at batch 128 in turns 1.96 and 2.09 before,
1.44 and 1.37 after; the batch-128 dispatch of shm-direct 1.95-2.15 ms before, 1.15-1.3 ms
after.

*Where a row lies in its page.* glibc before 2.39 copies a few KiB and more with `rep
movsb`, which AMD Zen 3 (the EPYC VMs these runs sometimes get) runs ~8x slower when the
destination lies 1-63 bytes past the source modulo 4 KiB: 112 KiB in 39 µs against 4.8 at
any other offset (glibc 2.36). Two numpy arrays malloc placed back to back sit exactly 16
bytes apart that way, and the copy bound and the cross-core probe used such a pair until
2026-12-02 (their batch-1 bound read 87 µs, above shm-owned's 37: a bound that was not
one); they now copy between page-aligned buffers (`ubep.bench.systems.page_aligned`). The
runtime met it
too: its receive areas are page-aligned, so an `x` 16 bytes before a page boundary (a
slice of a framework's flat workspace can lie anywhere) made every row's copy slow. Measured
with `benchmarks/scripts/bench_copy_alias.py` (batch 128, P=2, two runs each, alternated,
2026-12-02, AMD EPYC VM): the batch-128 dispatch from such an `x` took 5.7 and 3.9 ms
(shm-owned) and 3.7 and 3.7 ms (shm-direct) against 1.0-1.5 ms from any other offset;
`memcpy_at` now copies such rows in 2 KiB pieces, below glibc's `rep movsb` threshold, and
the same dispatch took 1.4 and 1.5 ms (owned), 1.9 and 1.4 ms (direct), inside the spread of
the other offsets (1.2-1.8 ms in those runs). The torch backend's rows cross gloo's copies,
not ours: no difference by offset.

*One worker per rank.* With 2 cores and 2 ranks each rank has one worker: kernel
decomposition has no second core to overlap its count, send and reorder roles on, so
shm-ubep and shm-bsp copy the same bytes in the same thread and differ by a flag round.

*Fixed costs at batch 1.* A batch-1 call moves 8 rows each way (~115 KB); what a shm call
spends beyond that is the wait for the peer and Python (validation, kernel entries, result
objects): in one process with no peer to wait for (`Buffer(backend="shm")` on a 1-rank
group, `benchmarks/scripts/bench_shm_overhead.py`, 3,000 calls, median), a dispatch+combine pair
takes ~19 µs with `direct=True` and ~20 µs with `direct="owned"` on an AMD EPYC VM
(2026-12-01, 06:10 UTC), 41 and 45 µs on an Intel Xeon VM whose copy bound is ~3x slower
(same day, 09:20 UTC): these machines differ from one session to the next, so read the
ratios. Moving the rows between two ranks also costs more than the copy bound's memcpy,
which copies bytes already in the copying core's cache: the same bytes copied as the other
core has just written them take 2.3-2.7x as long (the probe in the header above; 112 KiB:
9.6 vs 3.5 µs on the Intel VM), the coherence traffic every transport between two processes
pays at least once per row.

*The host's own gaps.* A tight clock loop on each core (`benchmarks/scripts/bench_host_gaps.py`,
3 s, AMD EPYC VM, 2026-12-02) saw 162 and 30 gaps longer than 20 µs a second on cores 0 and 1
at 10:45 UTC, and 470-880 and 420-740 an hour later (median gap 27-28 µs, 10-50 a second
longer than 50 µs). A call that needs both cores for d µs meets one about (gaps a second)
x (d + 28 µs) of the time: 1-2% of batch-1 shm calls at the first rate, 5-10% at the
second. So the p99 of any batch-1 call here is a gap, the copy bound's included (its own
p99/median in the table above), and at the second rate the median moves too: shm-owned's
batch-1 median in turns read 35.7 µs at 11:20 and 50.0 and 49.9 µs at 11:26-11:27 UTC, with
no change to the code between; in six runs of `ubep bench --systems shm-owned shm-direct
--tokens 1 --iters 200` at 12:03-12:06 it read 32.2 and 39.8 µs where every rank's probe saw
at most ~500 gaps a second, 49.4-58.7 µs where one saw 600-1350. Each run's rates are in
the header line (and in this file's first paragraph).

Most of the gaps come at fixed moments. On 2026-12-03 (11:55-12:35 UTC) 68-85% of those a
clock loop on each core saw (a C loop, and `benchmarks/scripts/bench_host_gaps.py`, which now
prints where they start) started inside one or two 50 µs windows of every millisecond of
the monotonic clock, the same windows on both cores (700-750 and 950-1000 µs into it in one
probe, 100-150 and 950-1000 in others: a timer tick's), the rest anywhere; `perf record -a`
over the probe found nothing of the VM's own running then (its kernel threads and perf
itself, < 0.3% of the samples), so it is the host that takes the core. Each run finds the
windows from its own gap probes (`benchmarks.timer_windows`; the first paragraph gives them)
and marks every timed call that ran across one on some rank (`samples.csv`, column
`in_timer_window`); the figures table gives the p99/median of the calls clear of them. In a
20,000-call loop of shm-owned at batch 1, clone expert, ~12:00 UTC: 28% of the calls ran across
a window; p99/median 3.22x over all calls, 4.26x over those, 2.71x over the calls clear of
them; 145 of the 251 calls slower than 3x the median ran across one. The rest of the tail is
the scattered gaps: 150-300 a second per core outside the windows meet a 36 µs call that needs
both cores in 1-2% of calls, still enough to set the p99 of 200. In the slow state they
dominate: `ubep bench --tokens 1 --block 20 --iters 2000 --systems shm-owned shm-direct
shm-ubep` at 12:05 UTC found one window (47% of the gaps) and the clear calls' p99/median
read 5.04x against 5.52x over all (shm-owned, median 42.0 µs).

The floor the host puts under a tail. Each run now replays, over its own gap probes (both
cores, at its start and its end), back-to-back calls of each row's median that need both
cores for all of it and never vary (`benchmarks.host_floor`: each core stops while it is
away, a call ends when the later core is done): the p99/median the host alone gives such a
call (`bench.csv` column `host_p99x`, `ubep bench`'s "p99/median (host floor)" column, and a
line per shm path in the figures table). Checked against a call that really is fixed work
(`benchmarks/scripts/bench_fixed_work.py 300`, 2026-12-03, 14:53-14:57 UTC: a numba loop of the
call's median on each rank, in turns with shm-owned at batch 1): measured 2.74, 4.61, 2.26,
2.89, 1.96 and 2.43x against replayed 3.88, 3.29, 2.21, 2.97, 1.96 and 2.08x (the lower ones
at medians of 86-93 µs), and fixed at 35 µs (`bench_fixed_work.py 300 35`, 14:57 UTC) 3.86,
3.08 and 3.07x against 3.08, 2.80 and 3.08x. So fixed work of the 34-37 µs the issue's median
target implies had a p99/median of 2.74-4.61x, above 3x in four runs of six: the 3x target
sits at this host's own floor, below it in most runs. shm-owned in the first runs: 5.43x
(floor 3.78x), 76.9x (3.24x: a p99 of 2,979 µs, fixed work's 171, not seen again in the seven
runs after it, six of which count the calls over 1 ms: 0-21 of 6,000), 2.95 (2.20), 4.76 (2.96),
2.41 (1.96) and 3.39x (2.12): 1.2-1.6x the floor apart from that run. In the runs with the
work fixed at 35 µs the fixed work read 33.9-35.8 µs while shm-owned read 88.0-93.8 in the
same turns: the slow state ("Two machines in one") slows the moving of lines between the two
cores, not the code.

The harness's own barrier added to the tail until 2026-12-03: a rank that waited more than
~50 yields for its peer slept, and a 20 µs sleep takes ~107 µs on this VM (the kernel's
default 50 µs timer slack and the VM's own wake-up), so the call timed after the barrier
started on one rank while the other still slept. `HostSync.barrier` now yields for 2 ms
before it sleeps and takes two rounds, the second releasing no rank before the last is
awake. A throwaway A/B in one process pair (8,000 batch-1 shm-owned calls per arm,
alternating every 20): p99 237.3 -> 167.3 µs at a median of 33.0, 264.0 -> 246.2 at 87.0.

*Two machines in one.* The same probe (`benchmarks/scripts/bench_host_gaps.py 3 8`, 2026-12-03,
03:08 UTC) counted 273-293 gaps longer than 20 µs a second per core (median gap 32-35 µs)
while the cores took 550-594 local timer interrupts a second, and then timed a fixed loop of
Python arithmetic in 1 s rounds: a core ran it at ~120 iterations a µs in some rounds and at
~68 in others (1.8x slower), alone or with the other core busy, switching from one second to
the next (the VM's cores share physical cores with other tenants; every run's header now
gives the same loop's speed on each rank at its start and end). At other times the loop
slowed only while both cores ran it: 99-102 iterations a µs on one core alone against 60-61 on
both at once (10:39 UTC the same day; at 09:22, 110-116 alone and 110-117 both at once), which
is what two hardware threads of one physical core do to each other; the writes of "What a
write to the peer's lines costs" below slowed the same way whenever the other core ran
anything. A median read in the slow
state is not the code's: four runs of `benchmarks/scripts/bench_shm_spins.py staged 256 1` one
after the other, alternating two versions of the staged path (`direct=False`), read 37.1,
60.7, 66.7 and 38.6 µs, the fast and the slow value once for each version. So a run's
absolute µs says which state the host was in, ratios within one run hold (every system takes
turns in both), and a p99 over a run that crossed states holds the slow state's calls, on
top of the ~30 µs gaps: the copy bound's own p99/median (the table above) is the floor a
system's is read against. (That A/B, a first poll that spins ~5 µs inside the staged path's kernels
before the Python wait as the direct paths do, measured no gain: pair median 43.6 vs 46.7 µs
in one alternating run. Its door, below, spins that long, to hand fewer calls to Python: the
same A/B through the door read 0.994 and 0.983, 64 against 256 rounds, with 101-165 against
254-276 calls of 1,600 going on in Python in one run.)

*Where a batch-1 call's time goes, warm and cold.* Timestamps at 38 points of the one-worker
`direct="owned"` path (a temporary instrumented copy; one process, 1-rank group, 2,000 calls,
medians; 2026-12-01, 18:30 UTC), calls back to back against calls each after 16 MB of other
memory traffic (what an attention layer does between two MoE layers): dispatch 27 -> 111 µs,
combine 25 -> 56 µs. Warm, the kernels are ~1/3 of the call and Python the rest, spread thin
(no line above 4 µs). Cold, the Python and torch glue triples or worse: entering
`Buffer.dispatch` and deciding eager vs autograd 1.6 -> 15.6 µs, input validation 3.7 -> 14.8,
choosing the receive area 1.7 -> 9.5, making `recv_x` (one `as_strided` view) 2.5 -> 17.2,
handle, stats and result 4.7 -> 13.2, combine's output tensor (`torch.empty`) 3.6 -> 13.4; the
kernels with their entries 16 -> 39. Each torch call's first touch after the caches were
flushed costs 5-40 µs here (attribute reads ~5, `torch.empty` ~30-75). Passing the first kernel
its five kept arrays as addresses instead (a numba call with arrays costs more than one with
integers when measured alone, fully cold) changed nothing in place: dispatch 100.1 vs 101.0 and
86.7 vs 87.3 µs cold, 24.4 vs 24.7 warm (in-process A/B, alternating every call). This is the
regime of run 2 (interleaved) and of a model; what would shrink it is a call path touching
fewer torch and numpy entry points, not faster kernels. One fix landed: the first poll of each
wait spins ~5 µs inside its kernel before returning to Python (`waits.INLINE_SPINS`, was ~0.2
µs), so a peer a few µs behind is met there instead of after entering and leaving the Python
wait (~3 µs each): in-process A/B, 2 ranks, batch 1, dispatch+combine median 61.3 -> 60.3 µs
owned, 61.8 -> 59.5 direct, 89.2 -> 79.0 owned on a busier host
(`benchmarks/scripts/bench_shm_spins.py`); batches 8 and 128 unchanged.

*Layer by layer, in place* (2026-12-01, 20:30-21:10 UTC, before `ubep.native`). Removing one
layer at a time from the same loop (`benchmarks/scripts/bench_shm_layers.py`: one process, 1-rank
group, `direct="owned"`, batch 1, the variants alternating every 20 calls, medians of ~5,600
calls each, two runs): the whole call 39.7 / 41.8 µs, the backend called directly 29.6 / 31.1,
its path directly 29.3 / 30.9. So `Buffer`'s layer (the inputs' checks, the lock, the
eager/autograd/compile decision, its frames) was ~10 µs of ~41, each piece costing ~1.5x in
place what it costs in a tight loop of its own: the dispatch inputs' fast check 3.1 µs alone,
3.6-4.0 in place (of which the compiled id scan 0.6); the deferred Stats of both ops ~1 µs.
`Buffer` now recognises the common eager call by that fast check alone and goes straight to the
backend: the whole call 40.7 -> 39.3 µs (one process, mean of two runs). One-worker direct
combines now also tell the peers they are done reading in the kernel entry that summed their
last token (one entry and one Python call fewer when nothing is missing): 0.967-0.986 of the
call before it (one process, in-process A/B, three runs). Both against the previous main,
in-process A/B (`benchmarks/scripts/bench_shm_ab.py`: the other tree imported under another package
name, the two Buffers alternating every 20 calls): one process 0.953, 0.965, 0.950; the 2-rank
pair 0.949, 0.953, 0.927, 0.956, 0.983 (medians of the slower rank's dispatch+combine,
1,200-1,600 calls each); after both, `Buffer`'s layer is still 9.5-11.6 µs of the call (its
checks ~4.4 µs alone, the two locks ~0.8). Tried and dropped: dispatch's counts and rows in one
kernel entry returning one packed array (the result's parts as numpy views), 0.985-0.998 of the
two-entry call (nothing: the saved entry and allocations cost what the returned array and its
views cost). What a 40 µs pair needed gone was the ~26 µs of Python and torch glue per
dispatch+combine (`Buffer` ~9, the path ~17; the kernels ~13): the next paragraph.

*A compiled call path* (`ubep.native`, 2026-12-01, 22:40 UTC - 2026-12-02, 00:40 UTC). A small
C++ torch extension, built by `make` into the venv (~30 s): the inputs' fast checks (same
answers as the Python ones, checked by property tests; in a tight loop 4.1 -> 0.16 µs for
dispatch's, 1.8 -> 0.08 for combine's), and the one-worker direct path's dispatch and combine
as one C++ entry each, which makes the result arrays, `recv_x` (a tensor on the lent area's
storage), combine's output and the result objects (handle, deferred Stats,
`DispatchResult`/`CombineResult`, filled as the Python constructors fill them) and calls the
numba kernels as cfuncs by address, without the GIL (`kernels/entries.py`: the same kernels, so
one protocol). Whatever waits (counts, rows or done words not in after the kernels' inline
spins), fp8 combines (fp16 ones too until 2026-12-03, docs/results/dtypes.md), `workers > 1`
and a build-less install keep the Python path.
In-process A/B against the previous main (`benchmarks/scripts/bench_shm_ab.py`, batch 1,
`direct="owned"` unless said): the compiled checks alone 0.855 (one process) and 0.851 (2-rank
pair); the entries with Python making the result objects, one process 0.490-0.545, the pair
0.514-0.557, 0.526-0.634 (`direct=True`), batch 128 0.962; the entries making them too, one
process 0.472 (19.0 vs 40.3 µs), the pair 0.426 and 0.431 (34.3 vs 80.6 and 79.6 µs); the
objects' move alone 0.79-0.84 (one process and pair, two runs each). In place, one process
(`benchmarks/scripts/bench_shm_layers.py`): the whole call 19.2 µs, `Buffer`'s layer 2.4, the
backend's 0.2, the path around its C++ entries 4.5, the entries alone 12.1 (`direct=True`, on a
slower host state minutes later: 27.2, 3.4, 0.2, 5.5, 18.0). What is left in Python is the
decision where rows go (which lent area is free, whether combine reads in place) and the
layers' frames; the entries are mostly the rows' copies and the cross-core traffic.

*The door* (`ubep.native`, 2026-12-02, 01:40-02:10 UTC). A call that follows other work (an
attention layer, another system's turn) starts on cold caches, and there Python costs far more
than warm: in one process, every call after writing 8 MB (a line of each 64 bytes, outside the
timed region), `direct="owned"`, batch 1: dispatch through `Buffer` 64-67 µs, through the
backend 47-48, the compiled entry alone (with its result objects) 32; combine 71-74, 60-62, 48
(a measurement script outside the repo, two runs); a trivial Python method chain (a lock, four
attribute reads and writes) took 6.5-9 µs cold against 1.5-1.8 warm. So about half a cold call
was the Python layers around the entries. The door (`native/door.cpp`) takes `Buffer`'s common
call on the direct path whole: the inputs' fast check, the Buffer's lock, its closed/broken
state and call counter, the free lent area (the storages' use counts, as `DirectPath` counts
them), the epoch, the compiled entry and the last stats, in one C++ call from `Buffer.dispatch`
/ `Buffer.combine`; anything else (a held area everywhere, a first call of a dtype, an older
handle with `direct=True`, fp16 rows, an `out=` not contiguous or on the rows, bad input, a
closed or broken Buffer) it declines before
changing anything and the Python layers run as before; a wait goes on in Python, the lock held.
In-process A/B, two ranks, the same Buffer kind with the door on and off
(`benchmarks/scripts/bench_shm_door.py` and its first draft, 800 calls each, the slower rank's):
warm 0.818 and 0.830 (`direct="owned"`: 28.4 vs 34.8 and 26.4 vs 31.8 µs), 0.841 and 0.865
(`direct=True`); each call after evicting 8 MB: 0.927, 0.882, 0.586, 0.756 (owned; e.g. 84.5
vs 144.2 µs), 0.941, 0.702, 0.713, 0.812 (`direct=True`), the cold medians moving with the
host by up to 1.7x between runs minutes apart. Against bfada2a (the last main without
`ubep.native`, `benchmarks/scripts/bench_shm_ab.py`, pair): 0.378 (26.7 vs 70.6 µs).

*The staged path's door* (2026-12-03, 06:20-07:00 UTC). shm-ubep and shm-bsp (one worker,
`direct=False`: the paper's two copies through windows) had no compiled path: in one process
(`benchmarks/scripts/bench_shm_overhead.py ubep`, 1-rank group) a batch-1 dispatch+combine took
34.4 µs where `direct="owned"` took 11.0, its kernels ~15 µs of it and the rest Python between
them (line timing: the outputs' allocations 2.5-2.8 µs each, four entries unboxing their
arguments, the result objects). Its door (`native/staged.cpp`, kernels
`kernels/single_entries.py`) does what `door.cpp` does for the direct path: the check, the
lock and state, send, counts, outputs (from 256 KiB on, lent by the path's pool as in
Python), rows and results in one C++ call; a wait, a peer's dtype to check or an sp abort
goes on in Python from where it stopped. The same script: 12.9 µs (bsp 12.7, owned 11.6).
In-process A/B, two ranks, door on and off alternating
(`benchmarks/scripts/bench_shm_door.py --direct false`, 800 calls each, the slower rank's): 0.635
(37.5 vs 59.1 µs) and 0.787 (90.4 vs 114.8 µs, a run in which the host was slow throughout);
every call after evicting 8 MB: 0.558 (60.8 vs 108.9 µs); batch 8 0.828 (217.7 vs 263.0
µs), batch 32 0.946 (1,190 vs 1,257 µs; one run each, 400 calls).
Between two ranks it stays ~2x shm-owned's time (the table above): not Python now, but how
often its bytes cross cores.

*What a write to the peer's lines costs* (`benchmarks/scripts/bench_cross_core_writes.py`,
2026-12-03, 07:00-07:30 UTC). One process writes a batch-1 dispatch's bytes (8 rows of 14 KB
as window records) into shared memory a process on the other core read after the previous
write, as a receiver reads its window: 17.0-19.5 µs a write with the staged path's loop per
512-byte block, 17.9-24.4 with memcpy per block, 14.1-20.9 with one memcpy per row and one flag
(the direct paths' way), 15.0-15.8 with memcpy per 4 KiB block; 3.5-3.9 µs for the same writes
with no reader, in every way (three rounds each way, alternating, two runs; in runs minutes
later, the host in its slow state, 36-90 µs with a reader against the same 3.5-3.9 without).
Every line the other core holds is fetched or invalidated before it is written, whatever the
store instruction: the way of copying changes the cost by 20% at most, the number of times a
call's bytes go to the other core's lines changes it by the whole amount. The staged path
(two copies: window, then the expert-major output; combine back the same way) writes each
row into lines the peer holds twice per dispatch+combine (the receiver's window, then the
source's) and reads it from lines the peer wrote twice; the direct paths once each (a write
in dispatch, a read of expert outputs where they lie in combine). That, not the copy loops,
is what the paper's mechanism costs on a coherent CPU, where a GPU's remote writes over its
fabric do not pull lines from the reader first. A follow-up the same day (10:00-10:08 UTC, the
host in its slow state; scripts not kept) weakens the "lines" part of that reading: a reader
that only spun on a control word and never touched the written lines slowed the same writes
as much as one that read them (70.9-87.0 against 71.4-74.9 µs, three rounds alternating),
and writing each call to the next 112 KiB of a 16 MiB ring, whose lines the reader had last
read 150 calls before (long out of its 1 MiB L2), did not help (79.1-87.7); a reader blocked
in a pipe read while the writes ran gave 13.5-29.9 µs against 6.9-72.2 spinning (six rounds,
no consistent order). What the writes pay for is another process running on the other
vCPU, whatever it touches; which resource the two vCPUs share underneath is not visible from
inside the VM (`lscpu`: one thread per core, the `hypervisor` flag).

*The stand-in expert* (`benchmarks/scripts/bench_shm_expert.py`, 2026-12-03, 10:00 UTC). What a
call costs depends on what the expert did with recv_x. In one process pair, batch 1, each
Buffer kind with combine's input made three ways, alternating every 20 calls (medians of the
slower rank, dispatch+combine): `direct="owned"` 19.4 µs when combine takes recv_x itself,
64.0 when it takes `recv_x.clone()` (an expert's reads and its new output, untimed), 38.8
when the clone is written into `get_combine_buffer`'s tensor (the zero-copy API, the write
untimed); `direct=True` 19.0 / 62.8 / 38.1; the staged path 81.5 / 82.4. Split (a second
run): owned dispatch 10.5 -> 42.6 µs and combine 10.5 -> 39.8 from identity to clone, the
staged path's 50.4 / 44.9 and 49.7 / 44.1. With the identity the rows never leave the
sender's core (it writes them in dispatch and reads them back in combine), so the one-copy
paths paid nothing for crossing cores and the staged path, whose receiver copies each row out
of its window whatever the expert does, paid it all. `ubep bench` and `ubep results` now
clone (`--expert identity` gives the old convention): the batch-1 figures above are what a
model's MoE layer meets, and the staged path's distance from shm-owned at batch 1 is
1.05-1.3x (three `ubep results` runs at 10:09-10:48 UTC), not the 1.5-2.5x it read with
the identity.

*Ranks are bound to cores* (rank r's thread on the r-th usable core; `ubep bench --no-pin`
leaves them unbound), as vLLM's CPU workers bind their compute threads. gloo's threads,
started before, stay free: bound with the rank to its one core, every gloo collective there
stalled for a scheduler tick (~4 ms a call against ~0.3, 2026-12-01).
Unbound, two ranks that slept — in a gloo collective of the torch or AgRs system, or for a
millisecond — are often woken onto the same core and share it until the load balancer's next
pass: the following shm turn then runs at 140-200 µs a call instead of ~45, each rank's
spin-wait yielding to the other (`/proc/thread-self/stat` read before every call, 2026-12-01:
after a turn of gloo all-to-alls both ranks sat on one core in 6 of 8 shm turns; a rank that
migrated mid-turn dropped from ~170 to ~45 µs at once; bound, 0 of 32 turns shared a core and
no turn was slow). In the previous version of this file (unbound) such turns put the
shm-owned batch-1 median of run 1 at 53-59 µs against 28-30 µs in a bench of the shm systems
alone. A user running ranks unbound on a busy host sees the same: bind them.

*The first call of a turn.* What remains at the start of each turn is the host, not ubep: in
one process, a fixed workload (a 2 MB `np.copyto` and a 3,000-step Python loop, ~105 µs
warm) ran 1.8x slower on its first repetition after a 20 ms busy loop that touched nothing,
2.3x after 300 ms, and within 10% from the third repetition; after 1 ms, no slower. The
vCPUs of this VM share caches with other tenants, who evict what a rank does not touch for a
few milliseconds. A shm call after a turn of another system pays the same (first call
~100-250 µs, second ~50-80), and so does the copy bound. So each turn of run 1 starts with
one untimed call of the system, its lead (`leads.csv` of the run; the "cold call" lines of
the table above give its median against the timed calls'), and every timed call of run 1
follows a call of the same system: its p99 is the back-to-back calls' own. Until
2026-12-03 run 1 timed the lead too, one call in 20 (5%), so its p99 was always one of
them: in the run of 07:32 UTC that day shm-owned's p99/median read 7.90× with them and
3.16× without (the copy bound's own 4.53× and 1.42×; shm-ubep's 4.80× and 2.99×; the
leads' median 104 µs against 23.8). Run 2, where every call follows another system's, is
the regime a model's MoE layer meets between attention layers.

*torch.* Each token crosses to a rank once (however many of its experts live there) and one
partial sum per (token, rank) comes back. Dispatch's first `all_to_all_single` carries the
counts and, up to 64 KiB in all, the tokens themselves (batch 1: one collective); the rest take
a second; combine takes one. gloo spends ~0.1-0.3 ms on each even for a few KB (its
`gloo_tcp_loop` thread polls: ~30 `epoll_wait` and ~35 `recvfrom` calls per collective under
`strace`, ~50% of a core per rank). What the backend adds, on CPU all in compiled passes: the
send buffer written, recv_x gathered (the expert-major expansion: one pass over the received
rows, source by source so each token is read once for its k copies), the partial sums and their
sum at the source (in L1-sized chunks; the two changes took 6-8% off a batch-128
dispatch+combine in an in-process A/B, docs/results/torch_backend.md); a small collective is
started async and what needs nothing from the peers is done before its wait, which polls the
collective (yielding the core) before it blocks: a blocked thread's wake-up cost tens of µs and
a 3-5 ms p99 on this VM (docs/results/torch_backend.md). ~33 µs a pair at batch 1 in one
process (was ~60), ~1.5-2× that in place, where gloo's threads share the two cores.
`benchmarks/scripts/bench_torch_floor.py` replays the raw collectives with a busy wait of the
backend's measured host time in each gap; the backend's own collectives still run 1.1-1.3×
slower than the bare ones. With `ubep.native` the whole CPU call is compiled (next paragraph).

*The torch path, compiled* (`ubep.native`, 2026-12-02, 04:10-05:20 UTC). The Python between
the collectives (the numba entries' argument boxing, result arrays and views, the handle and
its state, `Buffer`'s layers) cost more than the collectives' own host work, on caches gloo's
threads had just used. `native/torch_path.cpp` runs a CPU dispatch or combine in C++: the same
kernels as numba cfuncs (`runtime/torch_entries.py`), the same collectives on the group's C++
`ProcessGroup` (`all_to_all_single`, polled as the Python path polls, then `wait()`: the
group's timeout and errors as before; a failed collective breaks the Buffer), the results made
in C++, and a door that takes `Buffer`'s common call whole, as on the shm path. Its words are
per row type and inline capacity, not per batch, and it reads the scratch buffers on every
call, so a server whose batch and routing change every step stays on it (a test drawing both
per call: 83-85% of dispatches and 90-93% of combines through the door, the rest the first call of
an inline capacity or a scratch that had to grow, which the Python path grows). Same bits as
the Python path (`tests/test_native_torch.py`). In-process A/B, 2 ranks, every call interleaved
with the Python path, the raw collectives and the copy (`benchmarks/scripts/bench_torch_native.py`,
three runs at batch 1, one at 8): batch 1 compiled / Python 0.471, 0.429, 0.545 (compiled /
(raw + copy) 1.34×, 1.24×, 1.53× against the Python path's 2.85×, 2.90×, 2.81×); batch 8 0.658
(1.42× against 2.17×). In `ubep results` (three runs, 05:16-05:19 UTC): batch 1 1.64×, 1.66×,
1.57× in turns, 1.41×, 1.43×, 1.51× interleaved (2.12-2.32× and 1.68-1.76× the session
before); batch 128 1.49-1.59× and 1.06-1.12×. What is left at batch 1 in turns, in place
(stats phases, one run): dispatch 140-155 µs against its raw collective's 104-106 (pack 2-3,
the collective and headers 107-111, plan and rows 10-16, results 6-9, `Buffer` and the entry
~15), combine 136-142 against 90-96; no single part is large. Later (08:00 UTC) its collectives
were given views of the scratch that only C++ holds (`at::from_blob`, launched below autograd)
instead of narrows, which went through the dispatcher's view bookkeeping; the count exchange
handed gloo the headers' Python-owned tensors, which gloo's thread dropped under the GIL when
the collective finished, taking it from the caller's next kernel (now C++-only views too;
`benchmarks/scripts/bench_torch_solo.py`, one rank: a compiled
dispatch 10-12 µs over its bare collective, combine 8-9, the Python path 53 and 28; three
`ubep results` runs at 08:08-08:11 UTC, a quieter host than at 05:16: batch 1 1.56×, 1.27×,
1.31× in turns, batch 128 1.41×, 1.38×, 1.46×).

*AgRs.* vLLM's path moves every token to every rank whatever the routing (one all-gather)
and reduce-scatters a `[all tokens, hidden]` tensor of partial sums: fewer rows than a
per-expert all-to-all when top-k covers most ranks (here 8 of 16 experts over 2 ranks), but
every rank computes and sends partial sums for every token. Its `agrs collectives` line is
the all-gather and the reduce-scatter alone on the same bytes; what the peer adds over them
is its layout (recv_x gathered by memcpy) and its sums (one compiled pass, as a fused MoE
kernel would do them). Before those two were made competent (and its workspaces kept, as a
serving engine keeps them) the peer ran 2-4x slower at batch 128 (combine ~30 ms, its
reduce-scatter ~7 ms of that): every "x agrs" before 2026-12-01 evening overstated ubep's lead.
gloo's reduce-scatter completes inside `wait()`, so the AgRs peer waits as torch's calls do
(blocking); the torch backend polls its all-to-alls (docs/results/torch_backend.md).

*MPI.* The peer a competent MPI programmer would write in Python: counts by `Alltoall`, rows
and their routing by two concurrent `Ialltoallv`, numpy to sort and reorder, one compiled pass
for the sums (until 2026-12-01 evening K torch multiply-adds over `[T, hidden]`: ~5 ms alone at
batch 128, hidden 7168; the peer's batch-128 combine 25.0 ms before, 4.6 ms after in one A/B on
a busy host: "x mpi" figures before then overstated ubep's lead at large batches). Its `mpi
collectives` line is those four calls alone. At batch 1 the peer took 7.4-7.5x that line (plus
the copy bound) while its bookkeeping was ~30 numpy calls; in three compiled passes (sort and
pack the sends, unpack into expert-major order, scatter outputs back) 3.1-3.8x, its batch-1
dispatch 322-385 -> 133-167 µs (`ubep bench --peers --systems mpi --tokens 1 128`, the previous
and the new peer alternated twice, 2026-12-01 night); what is left is mpi4py's per-call
argument handling and the result's tensors. Batch 128 unchanged (1.23-1.35x).
"""


def _xcopy_words(res: BenchResult) -> str:
    """The cross-core copy probe of run 1 in a sentence ("" if not measured)."""
    if 2 not in res.xcopy:
        return ""
    n, peer, own = res.xcopy[2]
    return (f" Copying the {n // 1024} KiB a batch-1 dispatch moves takes {peer:.1f} µs when "
            f"the other core has just written them and {own:.1f} µs from the copying core's "
            "own cache (the copy bound's case; `ubep.bench.flags.HostSync.cross_core_copy_us`"
            ").")


def _start_end(per_rank: list[tuple[float, float]]) -> tuple[str, str]:
    """A probe's values per rank at the start and at the end of a run, as "a/b" each."""
    starts, ends = zip(*per_rank)
    return "/".join(f"{v:.0f}" for v in starts), "/".join(f"{v:.0f}" for v in ends)


def _gaps_words(res: HostRecord) -> str:
    """The host's gaps and speed probes of a run in sentences ("" if not measured)."""
    out = ""
    if 2 in res.gaps:
        start, end = _start_end(res.gaps[2])
        out += (" The host took a rank's core away for more than 20 µs (a gap in a clock "
                f"loop, `benchmarks.probes.clock_gaps`) {start} times a second at the start of "
                f"run 1 and {end} at its end (ranks 0/1; \"The host's own gaps\" below says "
                "what that does to a batch-1 call)")
        w = res.windows.get(2)
        out += "." if w is None else (
            f"; {100 * w.share_of_gaps:.0f}% of the {w.gaps} gaps the probes saw started "
            "in the same " + " and ".join(f"{(hi - lo) / 1e3:.0f} µs" for lo, hi in w.spans)
            + f" of every {w.period_ns / 1e3:.0f} µs (`benchmarks.timer_windows`), "
            f"{100 * w.share_of_time:.0f}% of the time.")
    if 2 in res.speed:
        start, end = _start_end(res.speed[2])
        out += (f" A fixed loop ran at {start} iterations a µs at the start of run 1 and {end} "
                "at its end (`benchmarks.probes.loop_speed`; \"Two machines in one\" below: "
                "this host has a fast and a slow state).")
    return out


def render(turns: BenchResult, inter: BenchResult, command: str,
           host: HostRecord | None = None) -> str:
    """docs/results.md from the two runs (`host`: run 1's host probes, `host_record`)."""
    from ubep.bench.report import load_warning, markdown

    m = turns.machine
    out = [
        "# Results: ubep against the peers a user would pick instead, on this host", "",
        "Generated by one command (it runs the two benchmarks below and rewrites this file; "
        "the plots go to `docs/figures/`):", "",
        f"    {command}", "",
        f"Run at {m.get('time_utc')} on {m.get('cpu_model')}, {m.get('cpus_usable')} usable "
        f"cores, 1-minute load {m.get('load_avg_1m', 0):.1f} at the start; Python "
        f"{m.get('python')}, torch {m.get('torch')}"
        + (f", {' '.join(m['mpi'].split())}" if m.get("mpi") else "")
        + (f"; {m['native']}" if m.get("native") else "") + ". Flag round trip "
        f"{turns.rtt_us.get(2, 0):.2f} µs." + _xcopy_words(turns)
        + _gaps_words(host or HostRecord())
        + f" Run 1 took {turns.elapsed_s:.0f} s, run 2 {inter.elapsed_s:.0f} s.", "",
        "P=2 ranks, bf16, top-8, 16 experts, uniform routing, batch = tokens per rank. Every "
        "figure is a median (or p99) over iterations, or a ratio of two medians, of ONE run; "
        "absolute µs move with the host's load, ratios within a run much less. Run 1: "
        "systems take turns of 20 back-to-back iterations (as a decode loop calls one layer "
        "again and again), each turn led by one untimed call; run 2: every iteration "
        "interleaves all systems, so each call starts on caches the previous system "
        "evicted.", ""]
    for res in (turns, inter):
        w = load_warning(res)
        if w:
            out += [f"**Note ({'run 1' if res is turns else 'run 2'}):** {w}.", ""]
    out += ["## Figures against the targets (hidden 7168)", "", *figures(turns, inter), "",
            "× raw+copy: a system's median over (raw collectives + copy bound) medians of the "
            "same run — for `torch`, how much its own packing, reordering and reduction add "
            "to the collectives it cannot avoid; for `agrs` and `mpi` (and their own lines) "
            "against that peer's collectives (`agrs collectives`, `mpi collectives`) "
            "instead.", "",
            "![dispatch+combine latency vs batch, turns of 20](figures/bench_peers.png)", "",
            "## Run 1: turns of 20 back-to-back iterations", "", markdown(turns),
            "## Run 2: every iteration interleaved", "", markdown(inter),
            "![the same, interleaved every iteration](figures/bench_peers_interleaved.png)", "",
            "## What limits each system here", "", _LIMITS,
            "## What is measured", "", _MEASURED,
            "## Other results", "",
            "- `docs/results/e2e.md` — MoE decoding, time per output token per backend",
            "- `docs/results/simulator.md` — the paper's experiments on modelled superpods",
            "- `docs/results/torch_backend.md` — the torch backend against its raw "
            "collectives: where the time goes, and the floor on this host",
            "- `docs/results/sync.md` — the Data-as-Flag variants",
            "- `docs/results/scheduler.md` — the token-to-core scheduler",
            "- `docs/results/gpu.md` — the Triton path", ""]
    return "\n".join(out)


def results_main(args) -> int:
    """`python -m benchmarks results`: both runs, docs/results.md and its two plots."""
    from rich.console import Console

    from ubep.bench.report import print_report, save

    console = Console(width=150)
    runs_dir = Path(args.runs_dir or Path("results/results") / time.strftime("%Y%m%d-%H%M%S"))
    out = Path(args.out)
    turns_cfg, inter_cfg = configs(args.iters, args.warmup)
    done, hosts = [], []
    for name, cfg in (("turns", turns_cfg), ("interleaved", inter_cfg)):
        with console.status(f"benchmarking ({name}) ..") as status:
            res = run_bench(cfg, timeout_s=args.timeout, probe=HostProbes(),
                            progress=lambda msg, n=name: status.update(f"{n}: {msg}"))
        hosts.append(host_record(res))
        print_report(res, console)
        save(res, runs_dir / name)
        done.append(res)
    figs = out.parent / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    shutil.copy(runs_dir / "turns" / "bench.png", figs / "bench_peers.png")
    shutil.copy(runs_dir / "interleaved" / "bench.png", figs / "bench_peers_interleaved.png")
    command = "flock /tmp/ubep-bench.lock .venv/bin/python -m benchmarks results" + "".join(
        f" --{k} {v}" for k, v, d in (("iters", args.iters, ITERS), ("warmup", args.warmup, 10))
        if v != d) + f" --out {args.out}"
    out.write_text(render(*done, command=command, host=hosts[0]))
    console.print(f"wrote {out}, {figs / 'bench_peers.png'}, "
                  f"{figs / 'bench_peers_interleaved.png'}; runs in {runs_dir}")
    return 0


def register(subparsers) -> None:
    """Add `results` to the `ubep` command line."""
    p = subparsers.add_parser(
        "results", help="regenerate docs/results.md (two peer benches: turns, interleaved)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results.md", help="the markdown file to write")
    p.add_argument("--runs-dir", default=None,
                   help="where both runs' CSV/JSON/PNG go (default results/results/<time>)")
    p.add_argument("--iters", type=int, default=ITERS, help="timed iterations per point")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations per point")
    p.add_argument("--timeout", type=float, default=2400.0, help="limit per run, seconds")
    p.set_defaults(func=results_main)

