"""`ubep simulate --cluster`: hybrid vs flat on modelled clusters, DeepEP's figures beside."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from ubep.sim.cluster.config import HOSTS, ClusterConfig


def add_flags(p: argparse.ArgumentParser) -> None:
    """The cluster flags of `ubep simulate` (the workload flags are simulate's own)."""
    g = p.add_argument_group("--cluster: hybrid vs flat expert parallelism across hosts")
    g.add_argument("--cluster", action="store_true",
                   help="predict network bytes and dispatch/combine latency of the hybrid "
                   "(a row once per host) and flat (once per rank) backends on clusters of "
                   "--hosts x --ranks-per-host, with DeepEP's published internode figures "
                   "beside the model; writes CSV files and report.md to --cluster-out")
    d = ClusterConfig()
    g.add_argument("--hosts", default=",".join(map(str, HOSTS)),
                   help=f"host counts, comma-separated (default: {','.join(map(str, HOSTS))})")
    for name in ("ranks_per_host", "nic_gbps", "nic_latency_us", "nics_per_host",
                 "intra_host"):
        default = getattr(d, name)
        g.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=f"{ClusterConfig.help()[name]} (default: {default})")
    g.add_argument("--cluster-out", type=Path, default=Path("results/cluster"),
                   help="--cluster: output folder (default: results/cluster)")
    g.add_argument("--no-reference", action="store_true",
                   help="--cluster: skip the model runs in DeepEP's settings")


def config_of(args: argparse.Namespace) -> tuple[ClusterConfig, tuple[int, ...]]:
    """The `ClusterConfig` and host counts the flags name (simulate's workload flags)."""
    try:
        hosts = tuple(int(h) for h in str(args.hosts).split(",") if h.strip())
    except ValueError:
        raise ValueError(f"--hosts={args.hosts!r} must be comma-separated integers") from None
    if not hosts or min(hosts) < 1:
        raise ValueError(f"--hosts={args.hosts!r} must list host counts >= 1")
    kw = {name: getattr(args, name) for name in (
        "ranks_per_host", "nic_gbps", "nic_latency_us", "nics_per_host", "intra_host",
        "tokens_per_rank", "hidden", "top_k", "bytes_per_element", "routing", "hot_experts",
        "seed") if hasattr(args, name)}
    if getattr(args, "num_experts", 0):
        kw["num_experts"] = args.num_experts
    cfg = ClusterConfig(hosts=hosts[0], **kw)
    for h in hosts:
        replace(cfg, hosts=h)          # checks every host count against the experts
    return cfg, hosts


def run(args: argparse.Namespace, console) -> int:
    """Sweep, print the tables, write the CSV files and report.md."""
    from ubep.sim.cluster import reference
    from ubep.sim.cluster.metrics import comparison, write_csv
    from ubep.sim.cluster.sweep import sweep

    try:
        cfg, hosts = config_of(args)
        topo = cfg.topology()
    except (ValueError, TypeError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    out: Path = args.cluster_out
    console.print(f"cluster model: {topo.description}; {cfg.tokens_per_rank} tokens x "
                  f"{cfg.hidden} x {cfg.bytes_per_element} B, top-{cfg.top_k}, "
                  f"{cfg.num_experts} experts, {cfg.routing} routing")
    rows = sweep(cfg, hosts, progress=lambda h: console.print(f"  {h} hosts done"))
    table = comparison(rows)
    ll = nl = []
    if not args.no_reference:
        console.print("the model in DeepEP's settings ...")
        ll, nl = reference.low_latency(cfg), reference.normal(cfg)
    out.mkdir(parents=True, exist_ok=True)
    paths = [write_csv(rows, out / "cluster.csv"),
             write_csv(table, out / "cluster_comparison.csv")]
    if ll:
        paths += [write_csv(ll, out / "deepep_low_latency.csv"),
                  write_csv(nl, out / "deepep_normal.csv")]
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    report = out / "report.md"
    report.write_text(markdown(cfg, table, ll, nl, reference.v2()))
    _print_tables(console, cfg, table, ll, nl)
    console.print(f"wrote {', '.join(str(p) for p in paths)}, {report}")
    return 0


def _fmt(v) -> str:
    if not isinstance(v, float):
        return str(v)
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


COMPARISON = [("hosts", "hosts"), ("ranks", "ranks"), ("experts_per_rank", "experts/rank"),
              ("flat_MB_per_rank", "flat MB/rank"), ("hybrid_MB_per_rank", "hybrid MB/rank"),
              ("flat_MB_per_host", "flat MB/host"), ("hybrid_MB_per_host", "hybrid MB/host"),
              ("bytes_ratio", "bytes flat/hybrid"),
              ("flat_dispatch_us", "flat dispatch us"),
              ("hybrid_dispatch_us", "hybrid dispatch us"),
              ("flat_combine_us", "flat combine us"), ("hybrid_combine_us", "hybrid combine us"),
              ("speedup", "flat/hybrid (d+c)")]
LOW_LATENCY = [("ep", "EP"), ("hosts", "hosts"), ("deepep_dispatch_us", "DeepEP dispatch us"),
               ("model_dispatch_us", "model dispatch us"),
               ("deepep_combine_us", "DeepEP combine us"),
               ("model_combine_us", "model combine us")]
NORMAL = [("ep", "EP"), ("hosts", "hosts"), ("deepep_dispatch_GBps", "DeepEP dispatch GB/s"),
          ("model_dispatch_GBps", "model dispatch GB/s"),
          ("deepep_combine_GBps", "DeepEP combine GB/s"),
          ("model_combine_GBps", "model combine GB/s")]


def _titles(cfg: ClusterConfig) -> tuple[str, str, str]:
    nics = (f"one {cfg.nic_gbps:g} Gb/s NIC per rank" if not cfg.nics_per_host else
            f"{cfg.nics_per_host} x {cfg.nic_gbps:g} Gb/s NIC per host, shared by its ranks")
    return (f"hybrid vs flat, modelled: {cfg.ranks_per_host} ranks per host, {nics}, "
            f"{cfg.tokens_per_rank} tokens x {cfg.hidden} x {cfg.bytes_per_element} B, "
            f"top-{cfg.top_k} of {cfg.num_experts} experts, {cfg.routing} routing; network "
            f"bytes are dispatch's rows (combine sends as many partial rows back)",
            "DeepEP low-latency kernels (published) vs this model's per-expert policy in "
            "their setting (128 tokens, FP8 dispatch, BF16 combine)",
            "DeepEP normal kernels (published, 'bottleneck RDMA bandwidth') vs this model's "
            "hybrid policy in their setting (4096 tokens, at most 4 nodes per token)")


def _print_tables(console, cfg, table, ll, nl) -> None:
    from rich.table import Table

    titles = _titles(cfg)
    if console.width < 150:            # a pipe or a narrow terminal: do not truncate
        console.width = 150
    for title, cols, rows in ((titles[0], COMPARISON, table), (titles[1], LOW_LATENCY, ll),
                              (titles[2], NORMAL, nl)):
        if not rows:
            continue
        t = Table(title=title)
        for _, head in cols:
            t.add_column(head, justify="right")
        for r in rows:
            t.add_row(*(_fmt(r[k]) for k, _ in cols))
        console.print(t)


def markdown(cfg: ClusterConfig, table, ll, nl, v2) -> str:
    """The tables as Markdown (report.md; docs/results/multihost.md quotes them)."""
    titles = _titles(cfg)
    parts = []
    for title, cols, rows in ((titles[0], COMPARISON, table), (titles[1], LOW_LATENCY, ll),
                              (titles[2], NORMAL, nl),
                              ("DeepEP V2 (published, README; not modelled: its routing and "
                               "byte count differ)",
                               [("ep", "EP"), ("deepep_dispatch_GBps", "dispatch GB/s"),
                                ("deepep_combine_GBps", "combine GB/s")], v2)):
        if not rows:
            continue
        parts.append(f"{title}\n")
        parts.append("| " + " | ".join(h for _, h in cols) + " |")
        parts.append("|" + "---:|" * len(cols))
        parts.extend("| " + " | ".join(_fmt(r[k]) for k, _ in cols) + " |" for r in rows)
        parts.append("")
    return "\n".join(parts)
