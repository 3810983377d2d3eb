"""DeepEP's published internode figures beside the model run in DeepEP's own settings: a
sanity reference, not a fit (no constant of the model comes from them).

The figures and their source (repository, file, section, commit) are in
`ubep/sim/data/deepep_internode.toml`. The model is run as DeepEP measured:

* low-latency kernels: the "per-expert" policy (one message per (token, expert)), 128 tokens,
  FP8 dispatch rows of 7408 B (their count: 7168 + 7168/128 * 4 + 16), BF16 combine rows,
  uniform routing; latency compared directly.
* normal kernels: the "hybrid" policy (a row once per node, forwarded over NVLink), 4096
  tokens, routing limited to min(nodes, 4) nodes per token as their test draws it, FP8 rows
  of 7392 B; compared in their unit, the "bottleneck RDMA bandwidth": rows per (token, node
  holding one of its experts, its own node included) times the row's bytes, over the time.
"""

from __future__ import annotations

import tomllib
from importlib import resources

import numpy as np

from ubep.sim.cluster.config import ClusterConfig
from ubep.sim.cluster.sweep import predict, routing


def load_deepep() -> dict:
    """The published figures, as shipped (`sim/data/deepep_internode.toml`)."""
    text = resources.files("ubep.sim").joinpath("data", "deepep_internode.toml").read_text()
    return tomllib.loads(text)


def low_latency(config: ClusterConfig | None = None, progress=None) -> list[dict]:
    """DeepEP's low-latency table beside the per-expert model on the same cluster shape."""
    ref = load_deepep()["low_latency"]
    base = config or ClusterConfig()
    rows = []
    for i, ep in enumerate(ref["ep"]):
        hosts = max(1, ep // base.ranks_per_host)
        cfg = ClusterConfig(hosts=hosts, ranks_per_host=min(ep, base.ranks_per_host),
                            nic_gbps=base.nic_gbps, nic_latency_us=base.nic_latency_us,
                            intra_host=base.intra_host, tokens_per_rank=ref["tokens_per_rank"],
                            hidden=ref["hidden"], top_k=ref["top_k"], num_experts=256,
                            meta_bytes_per_row=0, seed=base.seed)
        d, c = predict(cfg, "per-expert", dispatch_row_bytes=ref["dispatch_row_bytes"],
                       combine_row_bytes=ref["combine_row_bytes"])
        rows.append({"ep": ep, "hosts": hosts,
                     "deepep_dispatch_us": ref["dispatch_us"][i],
                     "model_dispatch_us": d.latency_us,
                     "deepep_combine_us": ref["combine_us"][i],
                     "model_combine_us": c.latency_us})
        if progress is not None:
            progress(ep)
    return rows


def normal(config: ClusterConfig | None = None, progress=None) -> list[dict]:
    """DeepEP's normal-kernel table beside the hybrid model, in their bandwidth unit."""
    ref = load_deepep()["normal"]
    base = config or ClusterConfig()
    rows = []
    for i, ep in enumerate(ref["ep"]):
        hosts = ep // base.ranks_per_host
        cfg = ClusterConfig(hosts=hosts, ranks_per_host=base.ranks_per_host,
                            nic_gbps=base.nic_gbps, nic_latency_us=base.nic_latency_us,
                            intra_host=base.intra_host, tokens_per_rank=ref["tokens_per_rank"],
                            hidden=ref["hidden"], top_k=ref["top_k"],
                            num_experts=ref["num_experts"],
                            max_hosts_per_token=min(hosts, ref["max_hosts_per_token"]),
                            seed=base.seed)
        topk = routing(cfg)
        d, c = predict(cfg, "hybrid", topk=topk, dispatch_row_bytes=ref["dispatch_row_bytes"],
                       combine_row_bytes=ref["combine_row_bytes"])
        node_rows = _rows_per_token_node(topk, cfg)
        rows.append({"ep": ep, "hosts": hosts,
                     "deepep_dispatch_GBps": ref["dispatch_GBps"][i],
                     "model_dispatch_GBps": node_rows * ref["dispatch_row_bytes"]
                     / (d.latency_us * 1e3),
                     "deepep_combine_GBps": ref["combine_GBps"][i],
                     "model_combine_GBps": node_rows * ref["combine_row_bytes"]
                     / (c.latency_us * 1e3),
                     "model_dispatch_us": d.latency_us, "model_combine_us": c.latency_us})
        if progress is not None:
            progress(ep)
    return rows


def _rows_per_token_node(topk: np.ndarray, cfg: ClusterConfig) -> float:
    """Mean over ranks of the (token, node) pairs with an expert there (own node included),
    DeepEP's `num_rdma_token_sent`."""
    experts_per_host = cfg.num_experts // cfg.hosts
    host = np.where(topk >= 0, topk // experts_per_host, -1)
    s = np.sort(host, axis=2)
    distinct = (s >= 0).sum(axis=2) - ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).sum(2)
    return float(distinct.sum(axis=1).mean())


def v2() -> list[dict]:
    """DeepEP V2's README table (listed only; its routing and byte count differ from V1's)."""
    ref = load_deepep()["v2"]
    return [{"ep": f"{ref['ranks_per_host']} x {h}", "deepep_dispatch_GBps": d,
             "deepep_combine_GBps": c}
            for h, d, c in zip(ref["hosts"], ref["dispatch_GBps"], ref["combine_GBps"])]
