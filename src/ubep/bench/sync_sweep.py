"""The sync-variant microbenchmark (the paper's Fig. 10): dispatch latency vs payload per pair.

For P ranks (2 by default) and payloads from 16 B to 16 KB per (source, destination) pair,
time one dispatch with each sync variant (`Buffer(sync=v)`), interleaved: in every
iteration each variant runs once, in an order rotated per iteration, each call started
right after a tight cross-process barrier (`ubep.bench.flags.HostSync`). Per iteration the
time of a call is the max over ranks; the report gives the median and p99 over iterations.

Workload: `rows_per_pair` tokens per rank, each routed to every rank (one expert per rank,
top-k = P), so every (source, destination) pair carries exactly `rows_per_pair` rows of
`payload / rows_per_pair` bytes. Every variant's first call is checked against the oracle
(bit-exact rows) before anything is timed; each timed dispatch is followed by an untimed
combine, as in a real MoE layer.

    ubep bench --sync-sweep                 # through engineer F's `ubep bench`
    python -m ubep.bench.sync_sweep         # the same, standalone

With `--sweep-kind pingpong` (or `both`, the default) it also times the block formats
alone, without the runtime around them (`ubep.bench.sync_pingpong`): there the variants'
differences are not hidden by the per-call costs of a Python runtime.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ubep.options import BACKENDS, MODES, SYNCS

DEFAULT_PAYLOADS = tuple(16 << i for i in range(11))     # 16 B .. 16 KB
DATA_AS_FLAG = ("tff", "dc", "sp")
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class SyncSweepConfig:
    """What one sweep measures; checked on creation (errors name the field)."""

    payloads: tuple[int, ...] = field(default=DEFAULT_PAYLOADS,
                                      metadata={"help": "bytes per (source, destination) pair"})
    syncs: tuple[str, ...] = field(default=SYNCS, metadata={"help": "variants to compare"})
    ranks: int = field(default=2, metadata={"help": "process count P"})
    rows_per_pair: int = field(default=1, metadata={"help": "rows per (source, dest) pair"})
    iters: int = field(default=200, metadata={"help": "timed iterations per payload"})
    warmup: int = field(default=20, metadata={"help": "untimed iterations first"})
    backend: str = field(default="shm", metadata={"help": "Buffer backend: shm | torch"})
    mode: str = field(default="ubep", metadata={"help": "ubep | bsp"})
    block_bytes: int = field(default=512, metadata={"help": "sync block size in bytes"})
    dtype: str = field(default="bfloat16", metadata={"help": "row dtype"})
    workers: int | None = field(default=None, metadata={"help": "worker threads per rank"})
    timeout_s: float = field(default=30.0, metadata={"help": "deadline of every wait"})
    pingpong_rounds: int = field(default=100, metadata={"help": "ping-pong: rounds per run"})
    pingpong_runs: int = field(default=20, metadata={"help": "ping-pong: timed runs per point"})

    def __post_init__(self):
        if not self.payloads:
            raise ValueError("payloads must not be empty")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        unit = self.rows_per_pair * DTYPES[self.dtype]
        for p in self.payloads:
            if isinstance(p, bool) or not isinstance(p, int) or p < unit or p % unit:
                raise ValueError(f"payload {p!r} must be a positive multiple of rows_per_pair "
                                 f"* element size = {unit} bytes")
        if not self.syncs or any(s not in SYNCS for s in self.syncs):
            raise ValueError(f"syncs={self.syncs!r} must be a non-empty subset of {SYNCS}")
        if len(set(self.syncs)) != len(self.syncs):
            raise ValueError(f"syncs={self.syncs!r} lists a variant twice")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        for name, lo in (("ranks", 2), ("rows_per_pair", 1), ("iters", 1), ("warmup", 0),
                         ("block_bytes", 16), ("pingpong_rounds", 1), ("pingpong_runs", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} must be positive")

    def hidden(self, payload: int) -> int:
        """Elements per row that make `payload` bytes per (source, destination) pair."""
        return payload // (self.rows_per_pair * DTYPES[self.dtype])


@dataclass(frozen=True)
class SweepPoint:
    """One (payload, variant): latency over samples, µs (dispatch: max over ranks per
    iteration; ping-pong: one-way, half of each round trip)."""

    payload_bytes: int
    sync: str
    median_us: float
    p99_us: float
    min_us: float
    combine_median_us: float | None
    iters: int
    phases_us: dict[str, float] | None = None   # dispatch: median per phase (Stats), rank 0


@dataclass
class SyncSweepResult:
    """Every point of a sweep, what could not run, and how it was measured."""

    config: SyncSweepConfig
    points: list[SweepPoint]
    unavailable: dict[str, str]
    host: str
    seconds: float
    metric: str = "dispatch"          # "dispatch" (Buffer calls) | "pingpong" (formats alone)

    def point(self, payload: int, sync: str) -> SweepPoint | None:
        for p in self.points:
            if p.payload_bytes == payload and p.sync == sync:
                return p
        return None

    def fastest(self, payload: int) -> str | None:
        """The variant with the lowest median at `payload`."""
        pts = [p for p in self.points if p.payload_bytes == payload]
        return min(pts, key=lambda p: p.median_us).sync if pts else None

    def gain_over_sw(self, payload: int) -> tuple[str, float] | None:
        """(best Data-as-Flag variant, (sw - best) / sw of the medians) at `payload`."""
        sw = self.point(payload, "sw")
        daf = [p for v in DATA_AS_FLAG if (p := self.point(payload, v)) is not None]
        if sw is None or not daf:
            return None
        best = min(daf, key=lambda p: p.median_us)
        return best.sync, (sw.median_us - best.median_us) / sw.median_us

    def to_dict(self) -> dict:
        return {"metric": self.metric, "config": asdict(self.config), "host": self.host,
                "seconds": self.seconds, "unavailable": self.unavailable,
                "points": [asdict(p) for p in self.points]}


# -- what every rank runs ---------------------------------------------------------------------

def _workload(cfg: SyncSweepConfig, payload: int, world: int):
    import torch

    from ubep.testing import make_tokens

    rows, hidden = cfg.rows_per_pair, cfg.hidden(payload)
    dtype = getattr(torch, cfg.dtype)
    xs = [make_tokens(r, rows, hidden, dtype, seed=payload) for r in range(world)]
    idx = torch.arange(world, dtype=torch.int64).repeat(rows, 1)       # every token -> all
    ws = [torch.rand(rows, world, generator=torch.Generator().manual_seed(payload * 31 + r))
          for r in range(world)]
    return xs, idx, ws


def _same_bytes(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def sweep_rank(rank: int, world: int, cfg: SyncSweepConfig, payload: int) -> dict:
    """One rank's part of one payload: returns `{"times": {sync: [2, iters] µs (dispatch,
    combine)}, "unavailable": {sync: reason}}`. Collective over the default group."""
    import torch

    from ubep import Buffer, reference
    from ubep.bench.flags import HostSync

    torch.set_num_threads(1)
    xs, idx, ws = _workload(cfg, payload, world)
    ref = reference.dispatch(xs, [idx] * world, ws, world)[rank]
    x, w = xs[rank], ws[rank]
    job = os.environ.get("UBEP_JOB_ID", f"s{os.getpid()}") + f"-p{payload}"
    sync = HostSync.create(rank, world, job, timeout_s=max(cfg.timeout_s, 10.0))
    bufs: dict = {}
    unavailable: dict[str, str] = {}
    try:
        for v in cfg.syncs:
            # a variant that cannot be built or gets a wrong answer is dropped on every rank
            why = None
            try:
                bufs[v] = Buffer(num_experts=world, hidden=cfg.hidden(payload),
                                 max_tokens_per_rank=cfg.rows_per_pair, max_top_k=world,
                                 backend=cfg.backend, mode=cfg.mode, sync=v,
                                 block_bytes=cfg.block_bytes, workers=cfg.workers,
                                 timeout_s=cfg.timeout_s)
                res = bufs[v].dispatch(x, idx, w)
                if not _same_bytes(res.recv_x, ref.recv_x):
                    why = "dispatch differs from the oracle"
                bufs[v].combine(res.recv_x, res.handle)
            except Exception as e:  # noqa: BLE001 - reported as the variant's failure
                why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            why = _agree(why)
            if why is not None:
                unavailable[v] = why
                if v in bufs:
                    bufs.pop(v).close()
        order = list(bufs)
        times = {v: np.empty((2, cfg.iters)) for v in order}
        phases: dict = {v: {} for v in order}
        perf = time.perf_counter_ns
        for it in range(cfg.warmup + cfg.iters):
            k = it % max(len(order), 1)
            for v in order[k:] + order[:k]:
                sync.barrier()
                t0 = perf()
                res = bufs[v].dispatch(x, idx, w)
                t1 = perf()
                sync.barrier()
                t2 = perf()
                bufs[v].combine(res.recv_x, res.handle)
                t3 = perf()
                if it >= cfg.warmup:
                    times[v][:, it - cfg.warmup] = ((t1 - t0) / 1e3, (t3 - t2) / 1e3)
                    if res.stats is not None:
                        for name, us in res.stats.phases_us.items():
                            phases[v].setdefault(name, []).append(us)
        return {"times": times, "unavailable": unavailable,
                "phases": {v: {k: float(np.median(u)) for k, u in ph.items()}
                           for v, ph in phases.items()}}
    finally:
        for b in bufs.values():
            b.close()
        sync.close()


def _agree(reason: str | None) -> str | None:
    """Collective: None if no rank has a reason, else the first rank's."""
    import torch.distributed as dist

    reasons: list = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    bad = [(r, why) for r, why in enumerate(reasons) if why is not None]
    return None if not bad else f"rank {bad[0][0]}: {bad[0][1]}"


# -- the driver -------------------------------------------------------------------------------

def run_sync_sweep(cfg: SyncSweepConfig, *, progress: bool = True) -> SyncSweepResult:
    """Run the sweep (one launch of `cfg.ranks` processes per payload); return its points."""
    from rich.progress import Progress

    from ubep.testing import run_ranks

    points: list[SweepPoint] = []
    unavailable: dict[str, str] = {}
    start = time.monotonic()
    launch_timeout = 120.0 + cfg.timeout_s + (cfg.warmup + cfg.iters) * len(cfg.syncs) * 0.05
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("sync sweep", total=len(cfg.payloads))
        for payload in cfg.payloads:
            bar.update(task, description=f"sync sweep: {payload} B per pair")
            per_rank = run_ranks(sweep_rank, cfg.ranks, cfg, payload, timeout_s=launch_timeout)
            for v, why in per_rank[0]["unavailable"].items():
                unavailable.setdefault(v, f"at {payload} B: {why}")
            for v in per_rank[0]["times"]:
                t = np.max(np.stack([r["times"][v] for r in per_rank]), axis=0)   # [2, iters]
                d = t[0]
                points.append(SweepPoint(payload, v, float(np.median(d)),
                                         float(np.percentile(d, 99)), float(d.min()),
                                         float(np.median(t[1])), int(d.size),
                                         per_rank[0].get("phases", {}).get(v) or None))
            bar.advance(task)
    return SyncSweepResult(cfg, points, unavailable, _host(), time.monotonic() - start)


def _host() -> str:
    return f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus"


def run_sync_pingpong(cfg: SyncSweepConfig) -> SyncSweepResult:
    """The block formats alone (`ubep.bench.sync_pingpong`): one-way latency of a message of
    each payload per variant between 2 ranks, every delivery checked; metric "pingpong"."""
    from ubep.bench.sync_pingpong import pingpong_rank
    from ubep.testing import run_ranks

    bad = [p for p in cfg.payloads if p % 8]
    if bad:
        raise ValueError(f"payloads {bad} must be multiples of 8 bytes for the ping-pong")
    start = time.monotonic()
    out = run_ranks(pingpong_rank, 2, cfg.payloads, cfg.syncs, cfg.block_bytes,
                    cfg.pingpong_rounds, cfg.pingpong_runs, cfg.timeout_s,
                    timeout_s=300.0 + cfg.timeout_s)[0]
    points = []
    for payload in cfg.payloads:
        for v in cfg.syncs:
            d = out["samples"][(payload, v)]
            points.append(SweepPoint(payload, v, float(np.median(d)),
                                     float(np.percentile(d, 99)), float(d.min()), None,
                                     int(d.size)))
    return SyncSweepResult(cfg, points, {}, _host(), time.monotonic() - start, "pingpong")


# -- reports ----------------------------------------------------------------------------------

def _us(x: float) -> str:
    """Microseconds with the digits that mean something: 0.42, 12.3, 4852."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _size(n: int) -> str:
    return f"{n // 1024} KB" if n >= 1024 and n % 1024 == 0 else f"{n} B"


def sweep_table(result: SyncSweepResult):
    """A rich Table: one row per payload, median / p99 µs per variant, best DaF gain."""
    from rich.table import Table

    cfg = result.config
    if result.metric == "pingpong":
        title = (f"one-way message latency by block format, µs (median / p99), 2 ranks, "
                 f"block={cfg.block_bytes} B, {result.points[0].iters if result.points else 0} "
                 f"round trips")
    else:
        title = (f"dispatch latency by sync variant, µs (median / p99), {cfg.ranks} ranks, "
                 f"backend={cfg.backend}, mode={cfg.mode}, block={cfg.block_bytes} B, "
                 f"{cfg.iters} iters")
    table = Table(title=title)
    table.add_column("per pair", justify="right")
    for v in cfg.syncs:
        table.add_column(v, justify="right")
    table.add_column("best DaF vs sw", justify="right")
    for payload in cfg.payloads:
        best = result.fastest(payload)
        cells = []
        for v in cfg.syncs:
            p = result.point(payload, v)
            if p is None:
                cells.append("-")
                continue
            text = f"{_us(p.median_us)} / {_us(p.p99_us)}"
            cells.append(f"[bold green]{text}[/bold green]" if v == best else text)
        g = result.gain_over_sw(payload)
        cells.append(f"{g[0]} {g[1] * 100:+.0f}%" if g else "-")
        table.add_row(_size(payload), *cells)
    return table


def plot_sync_sweep(result: SyncSweepResult, path: str | Path) -> Path:
    """Median latency per variant vs payload per pair (log-x, log-y), p99 dashed; a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for v in result.config.syncs:
        pts = sorted((p for p in result.points if p.sync == v), key=lambda p: p.payload_bytes)
        if not pts:
            continue
        xs = [p.payload_bytes for p in pts]
        line, = ax.plot(xs, [p.median_us for p in pts], marker="o", label=f"{v} (median)")
        ax.plot(xs, [p.p99_us for p in pts], linestyle="--", color=line.get_color(),
                alpha=0.5, label=f"{v} (p99)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")          # p99 on a shared host can be 1000x the median
    ax.set_xticks(list(result.config.payloads))
    ax.set_xticklabels([_size(p) for p in result.config.payloads], rotation=45)
    ax.set_xlabel("payload per (source, destination) pair")
    cfg = result.config
    if result.metric == "pingpong":
        ax.set_ylabel("one-way latency (µs)")
        ax.set_title(f"Block formats alone (ping-pong), 2 ranks, block {cfg.block_bytes} B")
    else:
        ax.set_ylabel("dispatch latency (µs)")
        ax.set_title(f"Sync variants, {cfg.ranks} ranks, {cfg.backend}/{cfg.mode}, "
                     f"block {cfg.block_bytes} B")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_sync_sweep(result: SyncSweepResult, out_dir: str | Path) -> dict[str, Path]:
    """Write `<name>.csv`, `.json` and `.png` into `out_dir`; name = "sync_sweep" (dispatch)
    or "sync_pingpong"."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "sync_pingpong" if result.metric == "pingpong" else "sync_sweep"
    paths = {"csv": out / f"{name}.csv", "json": out / f"{name}.json"}
    with paths["csv"].open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["payload_bytes", "sync", "median_us", "p99_us", "min_us",
                     "combine_median_us", "iters"])
        for p in result.points:
            comb = "" if p.combine_median_us is None else f"{p.combine_median_us:.3f}"
            wr.writerow([p.payload_bytes, p.sync, f"{p.median_us:.3f}", f"{p.p99_us:.3f}",
                         f"{p.min_us:.3f}", comb, p.iters])
    paths["json"].write_text(json.dumps(result.to_dict(), indent=1))
    paths["png"] = plot_sync_sweep(result, out / f"{name}.png")
    return paths


def load_sync_sweep(path: str | Path) -> SyncSweepResult:
    """Read back a result written by `write_sync_sweep` (its `.json`), e.g. to re-plot it."""
    d = json.loads(Path(path).read_text())
    cfg = SyncSweepConfig(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in d["config"].items()})
    return SyncSweepResult(cfg, [SweepPoint(**p) for p in d["points"]], d["unavailable"],
                           d["host"], d["seconds"], d.get("metric", "dispatch"))


# -- command line -----------------------------------------------------------------------------

def add_sync_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Add `--sync-sweep` and its `--sweep-*` options to `parser` (e.g. `ubep bench`'s)."""
    g = parser.add_argument_group("sync sweep (Fig. 10: dispatch latency per sync variant)")
    g.add_argument("--sync-sweep", action="store_true",
                   help="run the sync-variant sweep instead of the system comparison")
    g.add_argument("--sweep-payloads", default=",".join(map(str, DEFAULT_PAYLOADS)),
                   help="bytes per (source, destination) pair, comma-separated "
                        "(default 16..16384, doubling)")
    g.add_argument("--sweep-syncs", default=",".join(SYNCS), help="variants (default all)")
    g.add_argument("--sweep-ranks", type=int, default=2, help="process count (default 2)")
    g.add_argument("--sweep-rows", type=int, default=1, help="rows per pair (default 1)")
    g.add_argument("--sweep-iters", type=int, default=200, help="timed iterations (200)")
    g.add_argument("--sweep-warmup", type=int, default=20, help="untimed iterations (20)")
    g.add_argument("--sweep-backend", default="shm", choices=BACKENDS, help="default shm")
    g.add_argument("--sweep-mode", default="ubep", choices=MODES, help="default ubep")
    g.add_argument("--sweep-block-bytes", type=int, default=512, help="default 512")
    g.add_argument("--sweep-workers", type=int, default=None, help="threads per rank")
    g.add_argument("--sweep-kind", default="both", choices=("dispatch", "pingpong", "both"),
                   help="dispatch: Buffer calls per variant; pingpong: the block formats alone "
                        "(one-way message latency); both (default)")
    g.add_argument("--sweep-pingpong-runs", type=int, default=20,
                   help="ping-pong: timed runs of 100 round trips per point (20)")
    g.add_argument("--sweep-out", default="results/sync_sweep",
                   help="folder for sync_sweep.{csv,json,png} (default results/sync_sweep)")


def config_from_args(args: argparse.Namespace) -> SyncSweepConfig:
    """The `SyncSweepConfig` of parsed `--sweep-*` options; ValueError names a bad one."""
    try:
        payloads = tuple(int(p) for p in str(args.sweep_payloads).split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--sweep-payloads={args.sweep_payloads!r} must be comma-separated "
                         f"integers") from None
    syncs = tuple(s.strip() for s in str(args.sweep_syncs).split(",") if s.strip())
    return SyncSweepConfig(payloads=payloads, syncs=syncs, ranks=args.sweep_ranks,
                           rows_per_pair=args.sweep_rows, iters=args.sweep_iters,
                           warmup=args.sweep_warmup, backend=args.sweep_backend,
                           mode=args.sweep_mode, block_bytes=args.sweep_block_bytes,
                           workers=args.sweep_workers,
                           pingpong_runs=getattr(args, "sweep_pingpong_runs", 20))


def run_sync_sweep_command(args: argparse.Namespace) -> int:
    """Handler for `--sync-sweep`: run, print the table, write CSV/JSON/PNG."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:      # piped or logged: do not squeeze the table
        console = Console(width=120)
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    kind = getattr(args, "sweep_kind", "dispatch")
    from ubep.runtime.memory_model import sync_info

    info = sync_info()
    console.print(f"sync guarantee here: {info.memory_model} ({info.machine}); flag/marker "
                  f"words: {info.flag_store}")
    results = []
    if kind in ("dispatch", "both"):
        results.append(run_sync_sweep(cfg))
    if kind in ("pingpong", "both"):
        results.append(run_sync_pingpong(cfg))
    for result in results:
        console.print(sweep_table(result))
        for v, why in result.unavailable.items():
            console.print(f"[yellow]{v} unavailable[/yellow]: {why}")
        paths = write_sync_sweep(result, args.sweep_out)
        console.print(f"wrote {', '.join(str(p) for p in paths.values())} "
                      f"({result.seconds:.0f} s, {result.host})")
    return 0 if all(r.points for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubep.bench.sync_sweep",
                                     description="Dispatch latency per sync variant (Fig. 10).")
    add_sync_sweep_args(parser)
    return run_sync_sweep_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
