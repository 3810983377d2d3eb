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

import dataclasses
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
#: the batches the doc's tables show (the figures table reads these; every batch is plotted)
DOC_BATCHES = (1, 16, 128)


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
    """The targets as one table: each figure from run 1 (turns) and run 2 (interleaved)."""
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
            add(f"{peer} / (its collectives + copy bound), batch {b}", "(competence)",
                tuple(ix.get((peer, h, b, "total"), {}).get("x_raw_copy") for ix in runs),
                None)
    bound = [ix.get((BOUND, h, 1, "total"), {}) for ix in runs]
    add("copy bound batch 1 p99 / median", "(floor)",
        tuple(None if not r else r["p99_us"] / r["median_us"] for r in bound), None)
    add("batch-1 dispatch bytes copied as the other core wrote them / from own cache",
        "(floor)",
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
        add(f"{system} batch 1 p99 / median, host floor", "(host)", floor, None)
        clear = [ix.get((system, h, 1, "total"), {}) for ix in runs]
        add(f"{system} batch 1 p99 / median, calls clear of the timer windows",
            "(host)", tuple(None if r.get("clear_p99_us") is None else
                            f"{r['clear_p99_us'] / r['clear_median_us']:.2f}× "
                            f"({100 * r['clear_share']:.0f}% of calls)" for r in clear), None)
        lead = turns.leads.get((system, 2, h, 1))
        add(f"{system} batch 1, a turn's first call / the timed calls (medians)", "(cold)",
            (None if lead is None or med[0] is None else float(np.median(lead)) / med[0],
             None), None)
    for peer in ("torch", "mpi", "agrs"):
        for system in _SHM_SYSTEMS[:1]:          # the default path, what a user gets
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
     '`Buffer(backend="shm", direct="owned")`, what `backend="auto"` gives on one host: counts '
     'first, each row copied once into a receive area lent as `recv_x`; results the caller '
     'owns, any handle combinable'),
    ('`shm-ubep`',
     '`Buffer(backend="shm", mode="ubep")`: the paper\'s mechanism (kernel decomposition, TFF '
     'epochs, rows via windows: two copies per row)'),
    ('`shm-direct`',
     '`Buffer(backend="shm", direct=True)`: counts first, each row copied once to its final '
     'place; combine reads expert outputs in place; `recv_x` valid until the next dispatch'),
    ('`shm-bsp`',
     '`Buffer(backend="shm", mode="bsp")`: the paper\'s barrier-separated baseline'),
    ('`torch`',
     '`Buffer(backend="torch")`, what `backend="auto"` gives across hosts: two or three '
     '`all_to_all_single` over gloo'),
    ('raw collectives',
     "the torch backend's `all_to_all_single` calls alone, on preallocated buffers of the "
     'byte counts it moved in this run (`Stats.extra["collectives"]`)'),
    ('agrs collectives',
     "the AgRs peer's all-gather and reduce-scatter alone, on buffers of the sizes it moves"),
    ('mpi collectives',
     "the MPI peer's `Alltoall` of counts, two `Ialltoallv` and the combine's `Alltoallv` "
     "alone, on buffers of its last dispatch's sizes"),
    ('`mpi`',
     '`ubep.bench.mpi_peer`: `MPI_Alltoall` counts, two concurrent `MPI_Ialltoallv` (rows; '
     'token, slot, weight), numpy reordering (MPICH wheel, `mpiexec`)'),
    ('`agrs`',
     "`ubep.bench.agrs_peer`: vLLM's CPU expert parallelism (`AgRsAll2AllManager`): one "
     "all-gather of every rank's rows and routing, the local rows summed per token (fp32), "
     "the partial sums reduce-scattered in bf16 (gloo)"),
    ('copy bound',
     'the bytes dispatch and combine must move on each rank (every routed row once each '
     "way), memcpy'd between page-aligned buffers by one core per rank at once, plus one "
     'flag round trip'),
)
_MEASURED = "| system | what it is |\n|:---|:---|\n" + "".join(
    f"| {name} | {text} |\n" for name, text in _SYSTEM_ROWS) + """
Each point (row width, batch) builds every rank's inputs from one seed (`bench_inputs`) and
checks one dispatch of every system byte for byte against `ubep.reference` (untimed; a
system that differs is dropped and listed as unavailable) before its timed iterations. Each
timed dispatch and combine starts right after a shared-memory barrier of both ranks; an
iteration's time is the max over ranks; Python's cyclic GC is paused. Between dispatch and
combine (untimed) the stand-in expert clones recv_x, as DeepEP's tests do, and combine takes
the clone, weighted. Each run probes the host on both cores at its start and end
(`benchmarks.probes`): gaps over 20 µs in a clock loop, the phases of the millisecond they
bunch in (`benchmarks.timer_windows`), a fixed loop's speed.
"""


_LIMITS = """\
*Absolute µs and ratios.* This host is a 2-core VM that switches between a fast and a slow
state (~1.8x apart) from one second to the next, and takes a core away tens to hundreds of
times a second, mostly at fixed phases of each millisecond (the timer tick). A run's absolute
µs say which state it met; ratios within a run hold, since every system takes its turns in
the same states. The p99 of any batch-1 call here is one of the host's gaps: read it against
the copy bound's own p99/median, the host floor (`benchmarks.host_floor`: back-to-back calls
of that median replayed over the gaps both cores saw) and the calls clear of the timer
windows.

*Two copies per row (shm-ubep, shm-bsp).* The paper's mechanism writes each row into a window
at its destination, then into the expert-major output; combine copies back, then reduces.
With one core a rank both copies run on that core, so at batch 128 these paths take up to
two copy bounds (the paper spreads them over a die's cores). shm-direct and shm-owned
exchange the counts first and copy each row once, by memcpy, to its final place
(docs/sync.md); combine reads expert outputs where they lie, after copying the cloned ones
peers read into shared memory (a model that writes into `get_combine_buffer`'s tensor skips
that copy). With 2 cores and 2 ranks each rank has one worker, so shm-ubep and shm-bsp copy
the same bytes in one thread and differ by a flag round.

*Fixed costs at batch 1.* A batch-1 call moves 8 rows each way (~115 KB); the rest of a shm
call is the wait for the peer and the work around the kernels (checks, placement, result
objects), one C++ call with `ubep.native`. Rows the other core just wrote cost more to copy
than the copy bound's cached bytes (the header's cross-core figure): coherence traffic every
transport between two processes pays. The torch backend against its collectives:
docs/results/torch_backend.md.
"""


def _xcopy_words(res: BenchResult) -> str:
    """The cross-core copy probe of run 1 in a sentence ("" if not measured)."""
    if 2 not in res.xcopy:
        return ""
    n, peer, own = res.xcopy[2]
    return (f" Copying the {n // 1024} KiB a batch-1 dispatch moves takes {peer:.1f} µs when "
            f"the other core has just written them, {own:.1f} µs from the copying core's own "
            "cache (the copy bound's case; `ubep.bench.flags.HostSync.cross_core_copy_us`).")


def _start_end(per_rank: list[tuple[float, float]]) -> tuple[str, str]:
    """A probe's values per rank at the start and at the end of a run, as "a/b" each."""
    starts, ends = zip(*per_rank)
    return "/".join(f"{v:.0f}" for v in starts), "/".join(f"{v:.0f}" for v in ends)


def _gaps_words(res: HostRecord) -> str:
    """The host's gaps and speed probes of a run in sentences ("" if not measured)."""
    out = ""
    if 2 in res.gaps:
        start, end = _start_end(res.gaps[2])
        out += (" The host took a rank's core away for over 20 µs "
                f"(`benchmarks.probes.clock_gaps`) {start} times a second at the start of run 1 "
                f"and {end} at its end (ranks 0/1)")
        w = res.windows.get(2)
        out += "." if w is None else (
            f"; {100 * w.share_of_gaps:.0f}% of the {w.gaps} gaps the probes saw started "
            "in the same " + " and ".join(f"{(hi - lo) / 1e3:.0f} µs" for lo, hi in w.spans)
            + f" of every {w.period_ns / 1e3:.0f} µs (`benchmarks.timer_windows`), "
            f"{100 * w.share_of_time:.0f}% of the time.")
    if 2 in res.speed:
        start, end = _start_end(res.speed[2])
        out += (f" A fixed loop ran at {start} iterations a µs at the start of run 1 and {end} "
                "at its end (`benchmarks.probes.loop_speed`).")
    return out


#: where the README's headline table sits (rewritten by `results` with every run)
README_START, README_END = "<!-- results: start -->", "<!-- results: end -->"


def headline_table(turns: BenchResult, inter: BenchResult) -> str:
    """The README's short table: the default path (shm-owned) against what a user would pick
    instead, and against the copy bound, as ratios of medians of one run each."""
    h, runs = HEADLINE_HIDDEN, (_index(turns), _index(inter))

    def cells(a: str, b: str, batch: int) -> str:
        return " | ".join(_fmt_x(_ratio(ix, a, b, h, batch)) for ix in runs)

    lines = ["| dispatch+combine, P=2, hidden 7168 bf16, top-8 | batch | turns of 20 | "
             "interleaved |", "|---|---:|---:|---:|"]
    for name, a, b in (("torch (gloo) / ubep's default path", "torch", "shm-owned"),
                       ("MPI peer / ubep's default path", "mpi", "shm-owned"),
                       ("vLLM's all-gather + reduce-scatter / ubep's default path", "agrs",
                        "shm-owned"),
                       ("ubep's default path / copy bound", "shm-owned", BOUND),
                       ("the paper's two-copy path / copy bound", "shm-ubep", BOUND)):
        for batch in (1, 128):
            if all(_ratio(ix, a, b, h, batch) is None for ix in runs):
                continue
            lines.append(f"| {name} | {batch} | {cells(a, b, batch)} |")
    return "\n".join(lines) + "\n"


def update_readme(path: Path, table: str) -> bool:
    """Put `table` between the README's markers; False (nothing written) without them."""
    text = path.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        return False
    path.write_text(text[:start + len(README_START)] + "\n" + table + text[end:])
    return True


def _headline(res: BenchResult) -> BenchResult:
    """`res` with the rows of the doc's tables only: the headline hidden size, `DOC_BATCHES`."""
    return dataclasses.replace(res, rows=[r for r in res.rows if r["hidden"] == HEADLINE_HIDDEN
                                          and r["batch"] in DOC_BATCHES])


def render(turns: BenchResult, inter: BenchResult, command: str,
           host: HostRecord | None = None) -> str:
    """docs/results.md from the two runs (`host`: run 1's host probes, `host_record`)."""
    from ubep.bench.report import markdown

    m = turns.machine
    out = [
        "# Results: ubep against the peers a user would pick instead, on this host", "",
        "Generated, with the plots in `docs/figures/`, by:", "",
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
        "figure is a median (or p99), or a ratio of two medians, of ONE run: absolute µs move "
        "with the host's load, ratios much less. Run 1: systems take turns of 20 back-to-back "
        "iterations, each led by one untimed call (a decode loop calling one layer); run 2 "
        "interleaves every iteration, so each call starts on caches another system evicted. "
        "The tables' notes say when the host was busy.", "",
        "## Figures against the targets (hidden 7168)", "", *figures(turns, inter), "",
        "Host floor: the p99/median the host's probed gaps alone give a call of that median "
        "that never varies; calls clear of the timer windows: the host's tail apart from the "
        "code's; a turn's first call follows another system's turn (cold caches). "
        "× raw+copy: a system's median over (its collectives + copy bound) medians of the "
        "same run: for `torch` the raw collectives (what its packing, reordering and "
        "reduction add to the collectives it cannot avoid), for `agrs` and `mpi` their own.",
        "",
        "![dispatch+combine latency vs batch, turns of 20](figures/bench_peers.png)", "",
        "## Run 1: turns of 20 back-to-back iterations", "",
        f"Hidden {HEADLINE_HIDDEN}, batches "
        + ", ".join(str(b) for b in DOC_BATCHES)
        + f"; the other batches are in the plots, hidden {PEERS_HIDDENS[0]} and every batch "
        "in the run's `bench.md`.", "", markdown(_headline(turns), phases=False),
        "## Run 2: every iteration interleaved", "", markdown(_headline(inter), phases=False),
        "![the same, interleaved every iteration](figures/bench_peers_interleaved.png)", "",
        "## Method", "", _MEASURED, _LIMITS,
        "Other results: docs/results/ (`e2e.md` MoE decoding, `simulator.md` the paper's "
        "experiments on modelled superpods, `torch_backend.md`, `sync.md` the Data-as-Flag "
        "variants, `scheduler.md`, `gpu.md` the Triton path).", ""]
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
    readme = Path(args.readme)
    if readme.exists() and update_readme(readme, headline_table(*done)):
        console.print(f"updated the headline table in {readme}")
    console.print(f"wrote {out}, {figs / 'bench_peers.png'}, "
                  f"{figs / 'bench_peers_interleaved.png'}; runs in {runs_dir}")
    return 0


def register(subparsers) -> None:
    """Add `results` to the `ubep` command line."""
    p = subparsers.add_parser(
        "results", help="regenerate docs/results.md (two peer benches: turns, interleaved)",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results.md", help="the markdown file to write")
    p.add_argument("--readme", default="README.md",
                   help="the file whose headline table (between its markers) is rewritten")
    p.add_argument("--runs-dir", default=None,
                   help="where both runs' CSV/JSON/PNG go (default results/results/<time>)")
    p.add_argument("--iters", type=int, default=ITERS, help="timed iterations per point")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations per point")
    p.add_argument("--timeout", type=float, default=2400.0, help="limit per run, seconds")
    p.set_defaults(func=results_main)

