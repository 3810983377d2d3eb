"""`ubep topology`: list, show and validate fabric descriptions (presets or TOML files)."""

from __future__ import annotations

import argparse
import math

import numpy as np

from ubep.plan.topology import PRESETS, Topology, rank_ranges

_COLORS = ("bright_white", "green", "yellow", "red", "magenta", "cyan", "blue")
_MAX_CELLS = 48
_MAX_HOST_BOXES = 64


def register(subparsers) -> None:
    p = subparsers.add_parser("topology", help="list, show or validate a fabric topology",
                              description=__doc__)
    sub = p.add_subparsers(dest="topology_command", metavar="ACTION")
    sub.required = True
    for name in ("show", "describe"):
        s = sub.add_parser(name, help="print tiers and the hop-class matrix of a preset or file")
        s.add_argument("topology", help=f"a preset ({', '.join(PRESETS)}) or a TOML file")
        s.add_argument("--ranks", type=int, default=None, help="scale to this many ranks")
        s.set_defaults(func=_show)
    v = sub.add_parser("validate", help="check a TOML topology file; errors name the bad key")
    v.add_argument("file")
    v.set_defaults(func=_validate)
    ls = sub.add_parser("list", help="list the shipped presets")
    ls.set_defaults(func=_list)
    pl = sub.add_parser("plan", help="plan one rank's dispatch of a random routing and show "
                        "each token worker's load per hop class")
    pl.add_argument("topology", help=f"a preset ({', '.join(PRESETS)}) or a TOML file")
    pl.add_argument("--ranks", type=int, default=None, help="scale to this many ranks")
    pl.add_argument("--rank", type=int, default=0, help="the planning rank")
    pl.add_argument("--experts", type=int, default=None, help="global experts (default: ranks)")
    pl.add_argument("--tokens", type=int, default=128)
    pl.add_argument("--top-k", type=int, default=8)
    pl.add_argument("--workers", type=int, default=None, help="default: the topology's")
    pl.add_argument("--schedule", default="hierarchical",
                    choices=("static", "balanced", "hierarchical"))
    pl.add_argument("--mode", default="ubep", choices=("ubep", "bsp"))
    pl.add_argument("--seed", type=int, default=0)
    pl.set_defaults(func=_plan)
    st = sub.add_parser("study", help="scheduler quality (vs exact optimum) and planning speed")
    st.add_argument("--instances", type=int, default=300, help="small instances (<= 12 sends)")
    st.add_argument("--paper-instances", type=int, default=30,
                    help="instances at the paper's scale (256 ranks, 128 tokens x top-8)")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--no-speed", action="store_true", help="skip the planning-time table")
    st.add_argument("--markdown", action="store_true", help="print Markdown tables")
    st.set_defaults(func=_study)


def load(spec: str, ranks: int | None = None) -> Topology:
    """A preset name or a TOML path, optionally scaled to `ranks`."""
    if spec in PRESETS:
        return Topology.preset(spec, ranks=ranks)
    topo = Topology.from_toml(spec)
    return topo if ranks is None else topo.with_ranks(ranks)


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _show(args: argparse.Namespace) -> int:
    console = _console()
    try:
        topo = load(args.topology, args.ranks)
    except (ValueError, TypeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    for line in describe(topo):
        console.print(line)
    return 0


def _validate(args: argparse.Namespace) -> int:
    console = _console()
    try:
        topo = Topology.from_toml(args.file)
    except (ValueError, TypeError) as e:
        console.print(f"[red]invalid:[/red] {e}")
        return 2
    console.print(f"[green]ok:[/green] {topo}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from rich.table import Table

    table = Table(title="topology presets")
    for col in ("name", "ranks", "workers/rank", "tiers", "description"):
        table.add_column(col)
    for name in PRESETS:
        t = Topology.preset(name)
        table.add_row(name, str(t.num_ranks), str(t.workers_per_rank),
                      " > ".join(x.name for x in t.tiers), t.description)
    _console().print(table)
    return 0


def describe(topo: Topology) -> list:
    """Rich renderables: a header, the tier table and the hop-class picture."""
    from rich.table import Table
    from rich.text import Text

    out: list = [Text(f"{topo.name}: {topo.description}".rstrip(": "), style="bold"),
                 f"{topo.num_ranks} ranks, {topo.workers_per_rank} workers per rank, "
                 f"atomic block {topo.atomic_block_bytes} B (flag {topo.flag_bytes} B)"]
    hops = topo.hop_matrix()
    pairs = np.bincount(hops.ravel(), minlength=topo.num_hop_classes)
    table = Table(title="hop classes")
    for col, just in (("class", "right"), ("tier", "left"), ("ranks/group", "right"),
                      ("latency ns", "right"), ("bandwidth GB/s", "right"),
                      ("peers of rank 0", "right"), ("pairs", "right")):
        table.add_column(col, justify=just)
    row0 = np.bincount(hops[0], minlength=topo.num_hop_classes)
    for h, name in enumerate(topo.hop_class_names()):
        tier = topo.tiers[h - 1] if h else None
        rpg = ("1" if tier is None else str(tier.ranks_per_group) if tier.groups is None
               else ",".join(str(len(g)) for g in tier.groups[:12])
               + (",..." if len(tier.groups) > 12 else ""))
        table.add_row(Text(str(h), style=_COLORS[h % len(_COLORS)]), name, rpg,
                      f"{topo.hop_latency_ns(h):g}", f"{topo.hop_bandwidth_GBps(h):g}",
                      str(row0[h]), str(pairs[h]))
    out.append(table)
    if topo.network_hop_class is not None:
        out.extend(host_boxes(topo))
    out.extend(hop_picture(topo))
    return out


def host_boxes(topo: Topology) -> list:
    """A cluster's hosts as boxes of their ranks (and the groups of the tiers inside a
    host), then the network tier that joins them."""
    from rich.columns import Columns
    from rich.panel import Panel
    from rich.text import Text

    net = topo.network_hop_class
    inner = list(range(len(topo.tiers) - 2))      # tiers inside a host, below the host tier
    boxes = []
    for h, ranks in enumerate(topo.hosts[:_MAX_HOST_BOXES]):
        body = Text(f"ranks {rank_ranges(ranks)}")
        members = set(ranks)
        for i in inner:
            groups = [g for g in topo.tier_groups(i) if g[0] in members]
            if len(groups) > 1:
                body.append(f"\n{topo.tiers[i].name}: ", style=_COLORS[(i + 1) % len(_COLORS)])
                body.append(" | ".join(rank_ranges(g) for g in groups))
        boxes.append(Panel(body, title=f"host {h}", subtitle=f"{len(ranks)} ranks",
                           expand=False, border_style=_COLORS[(net - 1) % len(_COLORS)]))
    out: list = [Text(f"{topo.num_hosts} hosts (shared-memory domains):", style="italic"),
                 Columns(boxes)]
    if topo.num_hosts > _MAX_HOST_BOXES:
        rest = topo.hosts[_MAX_HOST_BOXES:]
        out.append(Text(f"  ... and {len(rest)} more hosts ({sum(map(len, rest))} ranks)"))
    bw, lat = topo.hop_bandwidth_GBps(net), topo.hop_latency_ns(net)
    host = topo.tiers[-2] if len(topo.tiers) > 1 else None
    line = Text("  network: ", style="bold")
    line.append(f"hop class {net} {topo.tiers[-1].name!r}", style=_COLORS[net % len(_COLORS)])
    line.append(f", {bw:g} GB/s per rank ({bw * 8:g} Gb/s), {lat / 1e3:g} us one-way")
    if host is not None:
        line.append(f"; inside a host {host.name!r}: {host.bandwidth_GBps:g} GB/s, "
                    f"{host.latency_ns / 1e3:g} us")
    out.append(line)
    return out


def _cell_size(topo: Topology) -> int:
    """Ranks per picture cell: 1, or the smallest tier group that fits the picture."""
    if topo.num_ranks <= _MAX_CELLS:
        return 1
    for tier in topo.tiers:
        if math.ceil(topo.num_ranks / tier.ranks_per_group) <= _MAX_CELLS:
            return tier.ranks_per_group
    return math.ceil(topo.num_ranks / _MAX_CELLS)


def hop_picture(topo: Topology) -> list:
    """The hop-class matrix as rows of colored digits; large fabrics in blocks of ranks."""
    from rich.text import Text

    hops = topo.hop_matrix()
    c = _cell_size(topo)
    n = math.ceil(topo.num_ranks / c)
    if c == 1:
        title = f"hop class of every (src row, dst column) pair, {topo.num_ranks} ranks:"
        cells = hops
    else:
        title = (f"hop class between groups of {c} ranks ({n} x {n} cells; a cell shows the "
                 f"largest class inside it):")
        pad = np.full((n * c, n * c), -1, dtype=np.int64)
        pad[:topo.num_ranks, :topo.num_ranks] = hops
        cells = pad.reshape(n, c, n, c).max(axis=(1, 3))
    lines = [Text(title, style="italic")]
    for row in cells:
        t = Text("  ")
        for h in row:
            t.append(f"{h} " if h >= 0 else "  ", style=_COLORS[h % len(_COLORS)])
        lines.append(t)
    if c > 1:  # and the inside of the first cell, rank by rank (at most 32 of them)
        m = min(c, topo.num_ranks, 32)
        lines.append(Text(f"ranks 0..{m - 1} (inside the first cell):", style="italic"))
        for row in hops[:m, :m]:
            t = Text("  ")
            for h in row:
                t.append(f"{h} ", style=_COLORS[h % len(_COLORS)])
            lines.append(t)
    legend = Text("  legend: ")
    for h, name in enumerate(topo.hop_class_names()):
        legend.append(f"{h}={name} ", style=_COLORS[h % len(_COLORS)])
    lines.append(legend)
    return lines


def _plan(args: argparse.Namespace) -> int:
    from rich.table import Table

    from ubep.plan import make_plan

    console = _console()
    try:
        topo = load(args.topology, args.ranks)
        experts = args.experts or topo.num_ranks
        rng = np.random.default_rng(args.seed)
        k = min(args.top_k, experts)
        idx = np.argsort(rng.random((args.tokens, experts)), axis=1)[:, :k]
        plan = make_plan(idx, topology=topo, rank=args.rank, num_experts=experts,
                         workers=args.workers or topo.workers_per_rank,
                         schedule=args.schedule, mode=args.mode)
    except (ValueError, TypeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    console.print(repr(plan), soft_wrap=True)
    counts = plan.hop_counts()
    table = Table(title=f"sends per token worker and hop class ({plan.schedule})")
    table.add_column("worker", justify="right")
    for h, name in enumerate(plan.hop_names):
        table.add_column(f"{h} {name}", justify="right", style=_COLORS[h % len(_COLORS)])
    table.add_column("total", justify="right")
    for j, row in enumerate(counts):
        table.add_row(str(plan.count_workers + j), *map(str, row), str(row.sum()))
    console.print(table)
    return 0


def _study(args: argparse.Namespace) -> int:
    from ubep.plan import quality

    small, small_meta = quality.small_instance_study(args.instances, args.seed)
    big, big_meta = quality.paper_scale_study(args.paper_instances, args.seed)
    speed = [] if args.no_speed else quality.planning_times()
    tables = [
        (f"objective / exact optimum, {small_meta['instances']} instances of "
         f"{small_meta['sends_min']}-{small_meta['sends_max']} sends on 2-4 workers "
         f"({small_meta['topology']}, {small_meta['ranks']} ranks, "
         f"{small_meta['row_bytes']} B rows)",
         ["schedule", "mean", "p95", "worst", "optimal"],
         [[r.schedule, f"{r.mean:.3f}", f"{r.p95:.3f}", f"{r.worst:.3f}",
           f"{r.share_optimal:.0%}"] for r in small]),
        (f"objective / lower bound at paper scale, {big_meta['instances']} routings: "
         f"{big_meta['ranks']} ranks, {big_meta['tokens']} tokens x top-{big_meta['top_k']}, "
         f"{big_meta['workers']} workers ({big_meta['token_workers']} token workers)",
         ["schedule", "mean", "p95", "worst"],
         [[r.schedule, f"{r.mean:.3f}", f"{r.p95:.3f}", f"{r.worst:.3f}"] for r in big]),
    ]
    if speed:
        tables.append((
            "make_plan time per call (best of 7 x 200 calls; cpu = thread CPU time)",
            ["tokens x top-k", "experts", "workers", "engine", "schedule", "cpu us", "wall us"],
            [[f"{r['tokens']} x {r['top_k']}", str(r["experts"]), str(r["workers"]),
              r["engine"], r["schedule"], f"{r['cpu_us']:.1f}", f"{r['wall_us']:.1f}"]
             for r in speed]))
    if args.markdown:
        for title, cols, rows in tables:
            print(f"\n{title}\n")
            print("| " + " | ".join(cols) + " |")
            print("|" + "---|" * len(cols))
            for row in rows:
                print("| " + " | ".join(row) + " |")
        return 0
    from rich.table import Table

    console = _console()
    for title, cols, rows in tables:
        table = Table(title=title)
        for c in cols:
            table.add_column(c)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    return 0
