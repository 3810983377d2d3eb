"""Expert parallelism across hosts on a model: hybrid (a row once per host) vs flat (once
per rank) vs per-expert, from what crosses each NIC and each host fabric.

Separable parts: `config` (the cluster and workload, `ClusterConfig`), `policy` (which rows
cross which link), `cost` (what that costs on the topology), `metrics` (rows, tables, CSV),
`reference` (DeepEP's published internode figures beside the model), `sweep` (runs them).

    from ubep.sim.cluster import ClusterConfig, sweep, comparison
    rows = sweep(ClusterConfig(), hosts=(2, 4, 8, 16, 32))
    comparison(rows)      # flat beside hybrid: bytes per rank and host, latencies
"""

from ubep.sim.cluster.config import HOSTS, POLICIES, ClusterConfig
from ubep.sim.cluster.cost import OpCost, op_cost
from ubep.sim.cluster.metrics import ClusterRow, comparison, write_csv
from ubep.sim.cluster.policy import Traffic, combine_traffic, dispatch_traffic
from ubep.sim.cluster.sweep import predict, routing, sweep

__all__ = ["ClusterConfig", "ClusterRow", "HOSTS", "POLICIES", "OpCost", "Traffic",
           "combine_traffic", "comparison", "dispatch_traffic", "op_cost", "predict",
           "routing", "sweep", "write_csv"]
