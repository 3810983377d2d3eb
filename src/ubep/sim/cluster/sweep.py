"""Run the cluster model: routing (workload) -> traffic (policy) -> time (cost) -> rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ubep.sim.cluster.config import HOSTS, ClusterConfig
from ubep.sim.cluster.cost import op_cost
from ubep.sim.cluster.metrics import ClusterRow
from ubep.sim.cluster.policy import combine_traffic, dispatch_traffic
from ubep.sim.workload import make_group_limited_topk, make_topk


def routing(config: ClusterConfig) -> np.ndarray:
    """`[ranks, tokens_per_rank, top_k]` expert ids: the workload of `config`."""
    c = config
    if c.max_hosts_per_token:
        return make_group_limited_topk(c.num_ranks, c.tokens_per_rank, c.top_k,
                                       c.num_experts, groups=c.hosts,
                                       groups_per_token=c.max_hosts_per_token, seed=c.seed)
    return make_topk(c.num_ranks, c.tokens_per_rank, c.top_k, c.num_experts,
                     routing=c.routing, hot_experts=c.hot_experts, seed=c.seed)


def predict(config: ClusterConfig, policy: str, *, topk: np.ndarray | None = None,
            dispatch_row_bytes: int | None = None, combine_row_bytes: int | None = None
            ) -> tuple[ClusterRow, ClusterRow]:
    """Dispatch and combine of every rank under `policy` on `config`'s cluster.

    Arguments:
        config: cluster and workload.
        policy: "flat" | "hybrid" | "per-expert" (`ubep.sim.cluster.policy`).
        topk: a given routing (default: `routing(config)`).
        dispatch_row_bytes, combine_row_bytes: override the rows' bytes (e.g. FP8 rows with
            their scales), default `config.row_bytes` / `config.partial_bytes`.
    Returns:
        `(dispatch, combine)` `ClusterRow`s.
    """
    topo = config.topology()
    topk = routing(config) if topk is None else topk
    d = dispatch_traffic(topk, topo, config.num_experts, policy)
    c = combine_traffic(d)
    epr = config.num_experts // topo.num_ranks
    out = []
    for traffic, row in ((d, dispatch_row_bytes or config.row_bytes),
                         (c, combine_row_bytes or config.partial_bytes)):
        meta = config.meta_bytes if traffic.op == "dispatch" else 0
        cost = op_cost(traffic, topo, row_bytes=row, meta_bytes=meta,
                       header_bytes=config.header_bytes,
                       shared_nics=config.nics_per_host > 0)
        out.append(ClusterRow.of(traffic, cost, topo, row_bytes=row, meta_bytes=meta,
                                 header_bytes=config.header_bytes, experts_per_rank=epr,
                                 tokens_per_rank=config.tokens_per_rank))
    return out[0], out[1]


def sweep(config: ClusterConfig, hosts: tuple[int, ...] = HOSTS,
          policies: tuple[str, ...] = ("flat", "hybrid"), progress=None) -> list[ClusterRow]:
    """`predict` for every host count and policy (one routing per host count, shared by the
    policies, so they move the same tokens)."""
    rows = []
    for h in hosts:
        cfg = replace(config, hosts=h)
        topk = routing(cfg)
        for p in policies:
            rows.extend(predict(cfg, p, topk=topk))
        if progress is not None:
            progress(h)
    return rows
