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
    for system in _SHM_SYSTEMS:
        add(f"{system} batch 1 / copy bound", "≤ 6×",
            tuple(ix.get((system, h, 1, "total"), {}).get("x_bound") for ix in runs),
            lambda v: v <= 6)
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
the clone, weighted.
"""


_LIMITS = """\
*Ratios, not microseconds.* This host is a shared 2-core VM whose speed changes from one
second to the next and which takes a core away from a process tens of times a second, so
absolute µs and batch-1 tails say more about the host than about the code. Every figure
above is a ratio of medians taken in one run, where every system met the same host; the
tables give the medians and p99s they come from.

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


def render(turns: BenchResult, inter: BenchResult, command: str) -> str:
    """docs/results.md from the two runs."""
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
        f"{turns.rtt_us.get(2, 0):.2f} µs."
        + f" Run 1 took {turns.elapsed_s:.0f} s, run 2 {inter.elapsed_s:.0f} s.", "",
        "P=2 ranks, bf16, top-8, 16 experts, uniform routing, batch = tokens per rank. Every "
        "figure is a median (or p99), or a ratio of two medians, of ONE run: absolute µs move "
        "with the host's load, ratios much less. Run 1: systems take turns of 20 back-to-back "
        "iterations, each led by one untimed call (a decode loop calling one layer); run 2 "
        "interleaves every iteration, so each call starts on caches another system evicted. "
        "The tables' notes say when the host was busy.", "",
        "## Figures against the targets (hidden 7168)", "", *figures(turns, inter), "",
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
        "## Run 2: every iteration interleaved", "",
        "The same systems and batches, each call started on caches another system evicted: "
        "its ratios are the second column of the table above, its medians in the plot (every "
        "system and batch in the run's `bench.md`).", "",
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
    done = []
    for name, cfg in (("turns", turns_cfg), ("interleaved", inter_cfg)):
        with console.status(f"benchmarking ({name}) ..") as status:
            res = run_bench(cfg, timeout_s=args.timeout,
                            progress=lambda msg, n=name: status.update(f"{n}: {msg}"))
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
    out.write_text(render(*done, command=command))
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

