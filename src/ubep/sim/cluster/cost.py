"""What the rows of a `Traffic` cost on a cluster: the cost model, from the topology alone.

Mechanisms, each priced from the `ubep.Topology` (no fitted constant):

* the network: every rank's NIC (the "other host" hop class's per-rank bandwidth)
  serializes the bytes it sends and, separately, those it receives (full duplex); the busier
  direction of the busiest rank bounds the phase, plus the hop's one-way latency once (rows
  to different peers stream back to back). Routing words travel with their rows. NICs
  shared by the ranks of a host (`shared_nics`): the host's bytes over the host's NICs
  (the per-rank share times its ranks), so one busy rank may use the whole link.
* the host fabric (the hop classes inside a host, e.g. NVLink or shared memory): the same
  per-rank serialization at each pair's hop-class bandwidth, plus that class's latency.
* a count header to every network peer before a dispatch's rows (flat, hybrid): one
  network latency plus its bytes.
* sums (combine): the rows a rank reads to sum, at the local bandwidth (hop class 0).
* forwarding (hybrid): rows stream through the relay, one row forwarded as soon as it has
  arrived, so the stages overlap: a pipeline's time is its stages' latencies, plus the
  busiest stage's total, plus one row's time in each other stage.

Not modelled: per-message NIC overheads (message rate), congestion inside the switch
(non-blocking), the copy into the expert-major layout after a dispatch (each policy does one),
and kernel launch and synchronization costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ubep.plan.topology import Topology
from ubep.sim.cluster.policy import Traffic


@dataclass(frozen=True)
class Stage:
    """One stage of a pipeline: `latency_us` once, `total_us` of serialization on its
    busiest rank, `item_us` for one row."""

    latency_us: float
    total_us: float
    item_us: float


def pipeline_us(stages: list[Stage]) -> float:
    """Rows streaming through stages that overlap (each row moves on as soon as the stage
    before released it): latencies, plus the busiest stage, plus one row in every other."""
    stages = [s for s in stages if s.total_us > 0]
    if not stages:
        return 0.0
    busiest = max(range(len(stages)), key=lambda i: stages[i].total_us)
    return (sum(s.latency_us for s in stages) + stages[busiest].total_us
            + sum(s.item_us for i, s in enumerate(stages) if i != busiest))


@dataclass(frozen=True)
class OpCost:
    """The modelled time of one operation, every rank at once.

    Attributes:
        total_us: until the last rank is done.
        phases_us: "header" (count round), "network" (NIC serialization + latency of the
            busiest rank), "host" (the host fabric's, likewise), "reduce" (sums) and "data"
            (the rows' part: network and host overlapped, pipelined for hybrid).
        net_send_us, net_recv_us, host_us: `[P]` per-rank serialization times.
    """

    total_us: float
    phases_us: dict[str, float]
    net_send_us: np.ndarray
    net_recv_us: np.ndarray
    host_us: np.ndarray


def op_cost(traffic: Traffic, topology: Topology, *, row_bytes: int, meta_bytes: int = 0,
            header_bytes: int = 16, shared_nics: bool = False) -> OpCost:
    """Price `traffic` on `topology`.

    Arguments:
        traffic: rows per link (`ubep.sim.cluster.policy`).
        topology: the cluster; its "other host" class is the network, the classes inside
            a host its fabric, class 0 the local memory that sums read.
        row_bytes: bytes of one row (a dispatched row, or a combine partial).
        meta_bytes: routing bytes that travel with each row of `traffic.net_meta_rows`.
        header_bytes: bytes of one count header (`traffic.header_peers_net` per rank).
        shared_nics: the ranks of a host share its NICs (`Topology.cluster(nics_per_host=)`)
            instead of one NIC per rank.
    """
    P = topology.num_ranks
    if traffic.num_ranks != P:
        raise ValueError(f"traffic has {traffic.num_ranks} ranks, topology {P}")
    hop = topology.hop_matrix()
    net_class = topology.network_hop_class
    local_bw = topology.hop_bandwidth_GBps(0) * 1e3           # bytes per us
    # -- the network --
    if net_class is not None and traffic.net.any():
        net_bw = topology.hop_bandwidth_GBps(net_class) * 1e3
        net_lat = topology.hop_latency_ns(net_class) / 1e3
        nbytes = traffic.net * row_bytes + traffic.net_meta_rows * meta_bytes
        send = nbytes.sum(axis=1) / net_bw
        recv = nbytes.sum(axis=0) / net_bw
        if shared_nics:
            host_ids = topology.host_ids()
            ranks = np.bincount(host_ids, minlength=topology.num_hosts)
            per_host = np.maximum(np.bincount(host_ids, send, topology.num_hosts),
                                  np.bincount(host_ids, recv, topology.num_hosts)) / ranks
            net_total = float(per_host.max())
        else:
            net_total = float(np.maximum(send, recv).max())
        net_item = (row_bytes + (meta_bytes if traffic.net_meta_rows.any() else 0)) / net_bw
    else:
        net_bw = net_lat = net_total = net_item = 0.0
        send = recv = np.zeros(P)
    # -- the host fabric --
    rows = traffic.host_fabric_rows()
    used = rows > 0
    if used.any():
        bw = np.array([topology.hop_bandwidth_GBps(h) for h in range(topology.num_hop_classes)])
        pair_us = np.where(used, rows * row_bytes / (bw[hop] * 1e3), 0.0)
        host = np.maximum(pair_us.sum(axis=1), pair_us.sum(axis=0))
        host_total = float(host.max())
        host_lat = max(topology.hop_latency_ns(int(h)) for h in np.unique(hop[used])) / 1e3
        slowest = float(bw[np.unique(hop[used])].min()) * 1e3
        host_item = max(traffic.net_fanout, 1.0) * row_bytes / slowest
    else:
        host = np.zeros(P)
        host_total = host_lat = host_item = 0.0
    # -- count headers --
    header = 0.0
    if traffic.header_peers_net.any():
        header = net_lat + float(traffic.header_peers_net.max()) * header_bytes / net_bw
    elif traffic.op == "dispatch" and traffic.policy != "per-expert" and used.any():
        header = host_lat                                   # one host: headers in shm
    # -- sums --
    first = float(traffic.reduce_first.max(initial=0)) * row_bytes / local_bw
    relay = traffic.reduce_relay * row_bytes / local_bw
    last = float(traffic.reduce_last.max(initial=0)) * row_bytes / local_bw
    if traffic.op == "dispatch":
        first = last = 0.0
    # -- the rows --
    net_stage = Stage(net_lat, net_total, net_item)
    host_stage = Stage(host_lat, host_total, host_item)
    if traffic.policy == "hybrid" and net_total > 0:
        fan = max(traffic.net_fanout, 1.0)
        relay_stage = Stage(0.0, float(relay.max(initial=0.0)), fan * row_bytes / local_bw)
        if traffic.op == "dispatch":
            data = pipeline_us([net_stage, host_stage])
        else:
            data = pipeline_us([host_stage, relay_stage, net_stage])
    else:
        data = max(pipeline_us([net_stage]), pipeline_us([host_stage]))
    reduce = first + last + (float(relay.max(initial=0.0)) if traffic.op == "combine" else 0.0)
    total = header + first + data + last
    phases = {"header": header, "network": (net_lat + net_total) if net_total else 0.0,
              "host": (host_lat + host_total) if host_total else 0.0, "reduce": reduce,
              "data": data}
    return OpCost(total_us=total, phases_us=phases, net_send_us=send, net_recv_us=recv,
                  host_us=host)
