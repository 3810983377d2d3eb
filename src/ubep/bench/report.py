"""Show and save a `BenchResult`: rich tables, CSV files, a PNG and a JSON description.

rich and matplotlib (the `cli` extra) are imported by the functions that draw with them.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ubep.bench.config import AGRS_RAW, BOUND, MPI_RAW, RAW
from ubep.bench.run import BenchResult

if TYPE_CHECKING:                   # rich: the `cli` extra, imported where a table is drawn
    from rich.console import Console
    from rich.table import Table

_ORDER = ("shm-ubep", "shm-direct", "shm-owned", "shm-bsp", "torch", RAW, "mpi", MPI_RAW,
          "agrs", AGRS_RAW, BOUND)
_LABELS = {BOUND: "copy bound", RAW: "raw collectives", AGRS_RAW: "agrs collectives",
           MPI_RAW: "mpi collectives"}
#: lines that are bounds or bare collectives, not systems (dimmed in tables and plots)
_FLOORS = (BOUND, RAW, AGRS_RAW, MPI_RAW)


def _label(name: str) -> str:
    return _LABELS.get(name, name)


def _has_raw(res: BenchResult) -> bool:
    return any(r["system"] in _FLOORS[1:] for r in res.rows)


def _system_key(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)


def _us(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 10_000:
        return f"{v / 1000:.1f} ms"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _blocks(cfg) -> str:
    """How the systems took turns (see `runner._timed_loop`) and what the stand-in expert
    between dispatch and combine did (`BenchConfig.expert`)."""
    block = getattr(cfg, "block", 1)
    turns = ("systems interleaved every iteration" if block == 1 else
             f"systems in turns of {block} back-to-back iterations (each after one untimed "
             "call of the same system)")
    expert = getattr(cfg, "expert", "clone")
    return turns + (", combine's input a clone of recv_x (the stand-in expert)"
                    if expert == "clone" else ", combine's input recv_x itself")


def _rows(cfg) -> str:
    """The rows' dtype in words: fp8 dispatch with scales and the combine's dtype, or one."""
    if getattr(cfg, "fp8", False):
        return f"fp8 e4m3 rows + scales, {cfg.dtype} combine"
    return cfg.dtype


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}×"


def _tail(row: dict) -> str:
    """dispatch+combine's p99/median."""
    return f"{row['p99_us'] / row['median_us']:.1f}×"


def tables(res: BenchResult) -> list[Table]:
    """One table per (ranks, hidden): a row per (batch, system), dispatch/combine/total, and
    the total's tail."""
    from rich.table import Table

    index = {(r["system"], r["ranks"], r["hidden"], r["batch"], r["op"]): r for r in res.rows}
    points = sorted({(r["ranks"], r["hidden"]) for r in res.rows})
    cfg = res.config
    out = []
    for world, hidden in points:
        t = Table(title=f"P={world} ranks, hidden={hidden} {_rows(cfg)}, top-{cfg.top_k}, "
                        f"{cfg.experts} experts, {cfg.routing} routing — µs, median / p99 "
                        f"over {cfg.iters} iterations (max over ranks), {_blocks(cfg)}",
                  title_justify="left")
        raw = _has_raw(res)
        for col in ("batch", "system", "dispatch", "combine", "dispatch+combine",
                    "p99/median", "× ubep", "× bound",
                    *(["× raw+copy"] if raw else [])):
            t.add_column(col, justify="left" if col == "system" else "right")
        batches = sorted({r["batch"] for r in res.rows if (r["ranks"], r["hidden"]) ==
                          (world, hidden)})
        for b in batches:
            names = sorted({r["system"] for r in res.rows if (r["ranks"], r["hidden"],
                            r["batch"]) == (world, hidden, b)}, key=_system_key)
            for i, name in enumerate(names):
                cells = [index[(name, world, hidden, b, op)] for op in
                         ("dispatch", "combine", "total")]
                label = f"copy bound (+RTT {res.rtt_us.get(world, 0):.2f})" if name == BOUND \
                    else _label(name)
                t.add_row(str(b) if i == 0 else "", label,
                          *[f"{_us(c['median_us'])} / {_us(c['p99_us'])}" for c in cells],
                          _tail(cells[2]),
                          _x(cells[2]["x_ubep"]), _x(cells[2]["x_bound"]),
                          *([_x(cells[2].get("x_raw_copy"))] if raw else []),
                          end_section=i == len(names) - 1,
                          style="dim" if name in _FLOORS else None)
        out.append(t)
    return out


def load_warning(res: BenchResult) -> str | None:
    """A warning when other work competed for the cores during the run, else None."""
    m = res.machine
    load, cores = m.get("load_avg_1m"), m.get("cpus_usable") or m.get("cpus")
    if load is None or not cores or load <= 0.5 * cores:
        return None
    return (f"the host was busy (1-minute load {load:.1f} on {cores} cores): latencies include "
            f"waits for the scheduler; treat them as provisional")


def print_report(res: BenchResult, console: Console | None = None) -> None:
    """Tables, then the systems that did not run and why, then the machine."""
    from rich.console import Console

    console = console or Console()
    for t in tables(res):
        console.print(t)
    for name, why in sorted(res.unavailable.items()):
        console.print(f"[yellow]{name}: unavailable[/] — {why}")
    warning = load_warning(res)
    if warning:
        console.print(f"[yellow]note:[/] {warning}")
    m = res.machine
    load = m.get("load_avg_1m")
    console.print(f"[dim]{m.get('cpu_model')}, {m.get('cpus_usable')} usable cores, load "
                  f"{'?' if load is None else f'{load:.1f}'}; flag round trip "
                  + ", ".join(f"P={p}: {v:.2f} µs" for p, v in sorted(res.rtt_us.items()))
                  + cross_core(res) + f"; {pinning(res)}; "
                  f"{m.get('native', '?')}; "
                  f"{res.elapsed_s:.0f} s[/]")


def cross_core(res: BenchResult) -> str:
    """The cross-core copy probe in words ("" if not measured)."""
    return "".join(f"; cross-core copy P={p}: {n / 1024:.0f} KiB in {peer:.1f} µs "
                   f"({peer / own:.1f}× the {own:.1f} µs from the copying core's cache)"
                   for p, (n, peer, own) in sorted(res.xcopy.items()))


def pinning(res: BenchResult) -> str:
    """How the ranks were bound to cores, in words ("rank r on core c", or "unbound")."""
    parts = []
    for p, cores in sorted(res.cores.items()):
        if any(c is None for c in cores):
            parts.append(f"P={p}: ranks unbound")
        else:
            parts.append(f"P={p}: " + ", ".join(
                f"rank {r} on core{'s' if len(c) > 1 else ''} {','.join(map(str, c))}"
                for r, c in enumerate(cores)))
    return "; ".join(parts) or "ranks unbound"


def markdown(res: BenchResult, phases: bool = True) -> str:
    """The tables of `tables()` as GitHub markdown, and (`phases`) the Buffer backends' own
    phase times."""
    cfg = res.config
    index = {(r["system"], r["ranks"], r["hidden"], r["batch"], r["op"]): r for r in res.rows}
    lines = []
    for world, hidden in sorted({(r["ranks"], r["hidden"]) for r in res.rows}):
        raw = _has_raw(res)
        lines += [f"**P={world}, hidden={hidden} {_rows(cfg)}, top-{cfg.top_k}, {cfg.experts} "
                  f"experts** — µs, median / p99 of {cfg.iters} iterations (max over ranks), "
                  f"{_blocks(cfg)}", "",
                  "| batch | system | dispatch | combine | dispatch+combine | × ubep | × bound |"
                  + (" × raw+copy |" if raw else ""),
                  "|---:|:---|---:|---:|---:|---:|---:|" + ("---:|" if raw else "")]
        batches = sorted({r["batch"] for r in res.rows if (r["ranks"], r["hidden"]) ==
                          (world, hidden)})
        for b in batches:
            names = sorted({r["system"] for r in res.rows if (r["ranks"], r["hidden"],
                            r["batch"]) == (world, hidden, b)}, key=_system_key)
            for name in names:
                c = [index[(name, world, hidden, b, op)] for op in ("dispatch", "combine",
                                                                     "total")]
                cells = [f"{_us(x['median_us'])} / {_us(x['p99_us'])}" for x in c]
                lines.append(f"| {b} | {_label(name)} | {' | '.join(cells)} | "
                             f"{_x(c[2]['x_ubep'])} | {_x(c[2]['x_bound'])} |"
                             + (f" {_x(c[2].get('x_raw_copy'))} |" if raw else ""))
        lines.append("")
    lines += _phase_markdown(res) if phases else []
    for name, why in sorted(res.unavailable.items()):
        lines.append(f"- {name}: unavailable — {why}")
    warning = load_warning(res)
    if warning:
        lines.append(f"- note: {warning}")
    return "\n".join(lines) + "\n"


def _phase_markdown(res: BenchResult) -> list[str]:
    """Where the time goes inside each Buffer backend: one line per (point, system, op)."""
    if not res.phase_rows:
        return []
    lines = ["**Inside the backends** — each phase's median µs (max over ranks), as the "
             "backend's own stats report it; `outside` = measured call time − backend total "
             "(Buffer's validation and Python glue)", "",
             "| P | hidden | batch | system | op | backend total | outside | phases |",
             "|---:|---:|---:|:---|:---|---:|---:|:---|"]
    med = {(r["system"], r["ranks"], r["hidden"], r["batch"], r["op"]): r["median_us"]
           for r in res.rows}
    groups: dict[tuple, dict[str, float]] = {}
    for r in res.phase_rows:
        op, phase = r["phase"].split(":", 1)
        key = (r["ranks"], r["hidden"], r["batch"], _system_key(r["system"]), r["system"], op)
        groups.setdefault(key, {})[phase] = r["median_us"]
    for (world, hidden, batch, _, system, op), ph in sorted(groups.items()):
        total = ph.pop("backend_total", None)
        measured = med.get((system, world, hidden, batch, op))
        outside = measured - total if measured is not None and total is not None else None
        parts = ", ".join(f"{k} {_us(v)}" for k, v in sorted(ph.items(), key=lambda kv: -kv[1]))
        lines.append(f"| {world} | {hidden} | {batch} | {system} | {op} | {_us(total)} | "
                     f"{_us(outside)} | {parts} |")
    return lines + [""]


def write_csv(res: BenchResult, out_dir: Path) -> tuple[Path, Path]:
    """`bench.csv` (one row per point, system and op), `samples.csv` (every timed iteration),
    `leads.csv` (each turn's untimed first call, if the systems took turns) and `phases.csv`
    (the Buffer backends' own phase times, if any)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, samples = out_dir / "bench.csv", out_dir / "samples.csv"
    fields = list(res.rows[0]) if res.rows else ["system"]
    with summary.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(res.rows)
    with samples.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["system", "ranks", "hidden", "batch", "iter", "dispatch_us", "combine_us",
                    "total_us"])
        for key, t in sorted(res.samples.items()):
            for i in range(t.shape[1]):
                w.writerow([*key, i, *(f"{v:.3f}" for v in t[:, i])])
    if res.leads:
        with (out_dir / "leads.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["system", "ranks", "hidden", "batch", "turn", "total_us"])
            for (name, world, hidden, batch), t in sorted(res.leads.items()):
                w.writerows([name, world, hidden, batch, i, f"{v:.3f}"] for i, v in enumerate(t))
    if res.phase_rows:
        with (out_dir / "phases.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(res.phase_rows[0]))
            w.writeheader()
            w.writerows(res.phase_rows)
    return summary, samples


def write_json(res: BenchResult, out_dir: Path) -> Path:
    """`run.json`: the config, the machine, the flag round trip and unavailable systems."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "run.json"
    path.write_text(json.dumps({
        "config": res.config.to_dict(), "machine": res.machine,
        "flag_round_trip_us": {str(k): v for k, v in res.rtt_us.items()},
        "cross_core_copy": {str(k): {"bytes": n, "peer_written_us": a, "own_cache_us": b}
                            for k, (n, a, b) in res.xcopy.items()},
        "rank_cores": {str(k): v for k, v in res.cores.items()},
        "unavailable": res.unavailable, "elapsed_s": res.elapsed_s}, indent=2))
    return path


def write_png(res: BenchResult, out_dir: Path, filename: str = "bench.png") -> Path | None:
    """Latency (dispatch+combine median) vs batch, log-y, a line per system, bound dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals = [r for r in res.rows if r["op"] == "total"]
    points = sorted({(r["ranks"], r["hidden"]) for r in totals})
    if not points:
        return None
    fig, axes = plt.subplots(1, len(points), figsize=(5.2 * len(points), 4.2), squeeze=False)
    for ax, (world, hidden) in zip(axes[0], points):
        rows = [r for r in totals if (r["ranks"], r["hidden"]) == (world, hidden)]
        for system in sorted({r["system"] for r in rows}, key=_system_key):
            pts = sorted((r["batch"], r["median_us"]) for r in rows if r["system"] == system)
            xs, ys = zip(*pts)
            style = dict(linestyle="--", color="black", label="copy bound + flag RTT") \
                if system == BOUND else dict(linestyle=":", color="gray", label=_label(system)) \
                if system in _FLOORS[1:] else dict(marker="o", label=system)
            ax.plot(xs, ys, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("dispatch + combine, median µs")
        ax.set_title(f"P={world}, hidden={hidden} {_rows(res.config)}, top-{res.config.top_k}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save(res: BenchResult, out_dir: str | Path) -> list[Path]:
    """Write CSVs, run.json, bench.md and the PNG into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    paths = [*write_csv(res, out_dir), write_json(res, out_dir)]
    md = out_dir / "bench.md"
    md.write_text(markdown(res))
    paths.append(md)
    png = write_png(res, out_dir)
    return paths + ([png] if png else [])
