"""What a cluster prediction reports: one `ClusterRow` per (cluster, policy, op), tables, CSV."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from ubep.plan.topology import Topology
from ubep.sim.cluster.cost import OpCost
from ubep.sim.cluster.policy import Traffic


@dataclass(frozen=True)
class ClusterRow:
    """One operation under one policy on one cluster.

    Attributes:
        hosts, ranks_per_host, ranks, experts_per_rank, tokens_per_rank: the case.
        policy, op: "flat" | "hybrid" | "per-expert"; "dispatch" | "combine".
        net_rows_per_rank: rows a rank puts on the network (mean over ranks).
        net_bytes_per_rank, net_bytes_per_rank_max: those rows' bytes (hidden x element
            size per row; routing words apart), mean and largest over ranks.
        net_meta_bytes_per_rank: routing words and count headers on the network (mean).
        net_bytes_per_host: row bytes that leave a host through its NICs (mean over hosts).
        host_bytes_per_rank: row bytes a rank sends over the host fabric (mean).
        latency_us: the modelled time (`ubep.sim.cluster.cost`); the phases after it.
    """

    hosts: int
    ranks_per_host: int
    ranks: int
    experts_per_rank: int
    tokens_per_rank: int
    policy: str
    op: str
    net_rows_per_rank: float
    net_bytes_per_rank: float
    net_bytes_per_rank_max: int
    net_meta_bytes_per_rank: float
    net_bytes_per_host: float
    host_bytes_per_rank: float
    latency_us: float
    header_us: float
    network_us: float
    host_us: float
    reduce_us: float
    data_us: float

    @staticmethod
    def of(traffic: Traffic, cost: OpCost, topology: Topology, *, row_bytes: int,
           meta_bytes: int, header_bytes: int, experts_per_rank: int,
           tokens_per_rank: int) -> ClusterRow:
        sent = traffic.net_rows_sent()
        per_host = np.bincount(topology.host_ids(), weights=sent * row_bytes,
                               minlength=topology.num_hosts)
        meta = (traffic.net_meta_rows.sum(axis=1) * meta_bytes
                + traffic.header_peers_net * header_bytes)
        sizes = {len(g) for g in topology.hosts}
        return ClusterRow(
            hosts=topology.num_hosts, ranks_per_host=max(sizes), ranks=topology.num_ranks,
            experts_per_rank=experts_per_rank, tokens_per_rank=tokens_per_rank,
            policy=traffic.policy, op=traffic.op,
            net_rows_per_rank=float(sent.mean()),
            net_bytes_per_rank=float(sent.mean() * row_bytes),
            net_bytes_per_rank_max=int(sent.max() * row_bytes),
            net_meta_bytes_per_rank=float(meta.mean()),
            net_bytes_per_host=float(per_host.mean()),
            host_bytes_per_rank=float(traffic.host_fabric_rows().sum(axis=1).mean()
                                      * row_bytes),
            latency_us=round(cost.total_us, 3),
            **{f"{k}_us": round(v, 3) for k, v in cost.phases_us.items()})


def write_csv(rows: list, path: Path) -> Path:
    """Dataclass rows (or dicts) as one CSV file with a header line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dicts = [asdict(r) if hasattr(r, "__dataclass_fields__") else dict(r) for r in rows]
    names = list(dicts[0]) if dicts else [f.name for f in fields(ClusterRow)]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        w.writerows(dicts)
    return path


def comparison(rows: list[ClusterRow], a: str = "flat", b: str = "hybrid") -> list[dict]:
    """One line per cluster: policy `a` beside `b` (bytes, dispatch and combine latency)."""
    by = {(r.hosts, r.ranks_per_host, r.policy, r.op): r for r in rows}
    out = []
    for key in sorted({(r.hosts, r.ranks_per_host) for r in rows}):
        d_a, d_b = by.get(key + (a, "dispatch")), by.get(key + (b, "dispatch"))
        c_a, c_b = by.get(key + (a, "combine")), by.get(key + (b, "combine"))
        if not (d_a and d_b and c_a and c_b):
            continue
        out.append({
            "hosts": key[0], "ranks_per_host": key[1], "ranks": d_a.ranks,
            "experts_per_rank": d_a.experts_per_rank,
            f"{a}_MB_per_rank": d_a.net_bytes_per_rank / 1e6,
            f"{b}_MB_per_rank": d_b.net_bytes_per_rank / 1e6,
            f"{a}_MB_per_host": d_a.net_bytes_per_host / 1e6,
            f"{b}_MB_per_host": d_b.net_bytes_per_host / 1e6,
            "bytes_ratio": (d_a.net_bytes_per_rank / d_b.net_bytes_per_rank
                            if d_b.net_bytes_per_rank else float("nan")),
            f"{a}_dispatch_us": d_a.latency_us, f"{b}_dispatch_us": d_b.latency_us,
            f"{a}_combine_us": c_a.latency_us, f"{b}_combine_us": c_b.latency_us,
            "speedup": ((d_a.latency_us + c_a.latency_us) / (d_b.latency_us + c_b.latency_us)
                        if d_b.latency_us + c_b.latency_us else float("nan")),
        })
    return out
