"""`ubep simulate | calibrate | reproduce | tune`: the superpod simulator's commands.

The options of `simulate` and `tune` are generated from `SimConfig` (one flag per field,
its help text from the field's metadata).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, fields
from pathlib import Path

from ubep.sim.api import SimConfig
from ubep.sim.cluster import cli as cluster_cli


def _add_config_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    for f in fields(SimConfig):
        if f.name in skip:
            continue
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action="store_true",
                           help=f.metadata["help"])
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(default), default=default,
                       help=f"{f.metadata['help']} (default: {default})")


def _topology_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", default="cm384",
                   help="preset (cm384, nvl72, nvl576, ib-cluster) or TOML file")
    p.add_argument("--ranks", type=int, default=64, help="ranks to simulate (default: 64)")


def register(subparsers) -> None:
    s = subparsers.add_parser("simulate", help="simulate one dispatch/combine on a modelled "
                              "superpod fabric", description=_simulate.__doc__)
    _topology_flags(s)
    _add_config_flags(s)
    cluster_cli.add_flags(s)
    s.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of all ranks")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--use-tuned", action="store_true",
                   help="take the count-worker number from `ubep tune`'s cache if it has one")
    s.set_defaults(func=_simulate)

    c = subparsers.add_parser("calibrate", help="fit the simulator's constants to the "
                              "paper's published points", description=_calibrate.__doc__)
    c.add_argument("--out", type=Path, default=None,
                   help="where to write (default: the package's data/calibration.json)")
    c.add_argument("--max-nfev", type=int, default=40, help="model evaluations at most")
    c.add_argument("--check", action="store_true",
                   help="only re-run the shipped fit points and print model vs target")
    c.add_argument("--refresh", action="store_true",
                   help="re-evaluate the shipped fit with the current code and rewrite it")
    c.set_defaults(func=_calibrate)

    r = subparsers.add_parser("reproduce", help="the paper's experiments on the calibrated "
                              "model: CSV + PNG + report.md", description=_reproduce.__doc__)
    r.add_argument("--out", type=Path, default=Path("results/reproduce"), help="output folder")
    r.add_argument("--short", action="store_true", help="a ~30 s subset (CI, make demo)")
    r.add_argument("--topology", default="cm384",
                   help="preset: cm384, nvl72, nvl576, ib-cluster")
    r.set_defaults(func=_reproduce)

    t = subparsers.add_parser("tune", help="sweep the count-worker number in the simulator "
                              "and compare with the cost model", description=_tune.__doc__)
    _topology_flags(t)
    _add_config_flags(t, skip=("count_workers", "mode", "op"))
    t.add_argument("--max-count-workers", type=int, default=16)
    t.add_argument("--no-record", action="store_true",
                   help="do not write the best choice to the tuning cache")
    t.set_defaults(func=_tune)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _config(args: argparse.Namespace, **override) -> SimConfig:
    kw = {f.name: getattr(args, f.name) for f in fields(SimConfig) if hasattr(args, f.name)}
    kw.update(override)
    return SimConfig(**kw)


def _simulate(args: argparse.Namespace) -> int:
    """Simulate one dispatch or combine of every rank and print latency and phases."""
    from rich.table import Table

    from ubep.sim.api import execute, prepare
    from ubep.stats import write_chrome_trace

    console = _console()
    if args.cluster:
        return cluster_cli.run(args, console)
    try:
        cfg = _config(args)
        if args.use_tuned and cfg.count_workers == 0 and cfg.mode == "ubep":
            cfg = _with_tuned(args, cfg)
        res = execute(prepare(args.topology, cfg, ranks=args.ranks))
    except (ValueError, TypeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    summary = res.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        tab = Table(title=f"{res.config.op} on {res.topology}, {res.num_ranks} ranks x "
                    f"{res.workers} workers ({res.config.mode}, {res.config.sync}, "
                    f"{res.config.schedule})")
        tab.add_column("quantity")
        tab.add_column("value", justify="right")
        tab.add_row("latency", f"{res.latency_us:.2f} us")
        tab.add_row("effective bandwidth", f"{res.bandwidth_GBps:.1f} GB/s")
        tab.add_row("payload efficiency", f"{res.payload_efficiency:.3f}")
        tab.add_row("count workers", str(res.count_workers))
        ib = res.ingress_bytes
        tab.add_row("ingress per rank (max / mean)",
                    f"{ib.max() / 1e6:.3f} / {ib.mean() / 1e6:.3f} MB")
        tab.add_row("ingress floor (max bytes / port)", f"{res.ingress_floor_us:.2f} us")
        if res.uplink_floor_us > 0:
            tab.add_row("uplink floor (max rows through a group's up/downlink)",
                        f"{res.uplink_floor_us:.2f} us")
        for k, v in res.phases_us.items():
            tab.add_row(f"phase {k} (slowest rank)", f"{v:.2f} us")
        tab.add_row("simulation time", f"{res.plan_s + res.engine_s:.2f} s")
        console.print(tab)
    if args.trace:
        write_chrome_trace(res.all_stats(), args.trace)
        console.print(f"trace: {args.trace}")
    return 0


def _with_tuned(args: argparse.Namespace, cfg: SimConfig) -> SimConfig:
    """`cfg` with the tuning cache's count-worker choice, through the cost model."""
    from dataclasses import replace

    from ubep import tuning
    from ubep.plan.costmodel import choose_count_workers
    from ubep.sim.api import prepare

    prep = prepare(args.topology, cfg, ranks=args.ranks)
    hit = tuning.lookup(prep.topology.name, prep.workers, prep.num_experts,
                        cfg.tokens_per_rank)
    if hit is None:
        return cfg
    nc = choose_count_workers(prep.workers, prep.num_experts, cfg.top_k, cfg.tokens_per_rank,
                              tuned=hit)
    return replace(cfg, count_workers=nc)


def _calibrate(args: argparse.Namespace) -> int:
    """Fit the free cost constants by least squares to the paper's published points shipped
    in ubep/sim/data/paper_public.toml (and nothing else)."""
    from rich.table import Table

    from ubep.sim import calibrate as cal
    from ubep.sim.params import load_calibration

    console = _console()
    if args.check or args.refresh:
        rec = load_calibration()
        if not rec:
            console.print("[red]error:[/red] no calibration file shipped yet")
            return 2
        if args.refresh:
            rec = cal.refresh(rec)
            console.print(f"wrote {cal.write(rec, args.out)}")
        model = cal.check(rec) if args.check else [p["model"] for p in rec["points"]]
    else:
        rec = cal.fit(max_nfev=args.max_nfev, progress=console.print)
        path = cal.write(rec, args.out)
        console.print(f"wrote {path}")
        model = [p["model"] for p in rec["points"]]
    tab = Table(title=f"fit points (rms relative residual {rec['rms_relative_residual']:.3f})")
    for col in ("point", "target", "model", "residual"):
        tab.add_column(col, justify="left" if col == "point" else "right")
    for p, m in zip(rec["points"], model):
        tab.add_row(p["name"], f"{p['target']:.1f} {p['unit']}", f"{m:.1f}",
                    f"{(m - p['target']) / p['target']:+.3f}")
    console.print(tab)
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    """Regenerate the paper's experiments from the fitted model into --out."""
    from ubep.sim.reproduce import run

    report = run(args.out, short=args.short, topology=args.topology)
    console = _console()
    from rich.markdown import Markdown

    text = report.read_text()
    for title in PRINTED:
        start = text.find(f"\n## {title}")
        if start < 0:
            continue
        end = text.find("\n## ", start + 1)
        section = "\n".join(line for line in text[start:end if end > 0 else None].splitlines()
                             if not line.startswith("!["))
        console.print(Markdown(section))
    console.print(f"report with every experiment, CSVs and plots: {report}")
    return 0


#: report sections `ubep reproduce` prints (the rest stays in report.md)
PRINTED = ("Dispatch latency", "Token-Sending latency", "Per-worker Token-Sending",
           "sw / tff / dc / sp", "Count-worker sweep")


def _tune(args: argparse.Namespace) -> int:
    """Simulate n_count = 1..max for one workload; print the best and the cost model's pick,
    and record the best in the tuning cache (`ubep.tuning`) unless --no-record."""
    from rich.table import Table

    from ubep import tuning
    from ubep.sim.api import execute, prepare

    console = _console()
    rows = []
    try:
        base = _config(args, mode="ubep")
        prep = prepare(args.topology, base, ranks=args.ranks)
        top = min(args.max_count_workers, prep.workers - 1)
        for c in range(1, top + 1):
            cfg = _config(args, mode="ubep", count_workers=c)
            rows.append((c, execute(prepare(args.topology, cfg, ranks=args.ranks)).latency_us))
    except (ValueError, TypeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    best = min(rows, key=lambda r: r[1])
    model = prep.count_workers
    tab = Table(title=f"count workers on {args.topology}, {args.ranks} ranks, "
                f"batch {base.tokens_per_rank}")
    tab.add_column("count workers", justify="right")
    tab.add_column("latency (us)", justify="right")
    for c, v in rows:
        mark = (" best" if c == best[0] else "") + (" cost model" if c == model else "")
        tab.add_row(str(c), f"{v:.2f}{mark}")
    console.print(tab)
    console.print(f"best: {best[0]} ({best[1]:.2f} us); cost model (Eq. 4): {model}")
    if not args.no_record:
        path = tuning.record(prep.topology.name, prep.workers, prep.num_experts,
                             base.tokens_per_rank, best[0], latency_us=best[1],
                             source=f"ubep tune (simulated, {args.ranks} ranks)")
        console.print(f"recorded in {path}")
    return 0
