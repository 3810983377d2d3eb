"""The fabric as the engine reads it: hop classes, per-class latency and port bandwidth.

A thin, array-shaped view of a `ubep.Topology` combined with the `CostParams` that scale
it, so the engine never calls back into the topology object in its inner loops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ubep.sim.params import CostParams


@dataclass(frozen=True)
class Fabric:
    """Arrays the engine needs; build with `Fabric.of(topology, params)`."""

    name: str
    num_ranks: int
    workers_per_rank: int
    hop: np.ndarray            # [P, P] int64 hop class of (src, dst)
    latency_us: np.ndarray     # [C] access latency of each hop class (scaled), us
    port_bw_GBps: np.ndarray   # [C] one rank's port bandwidth per hop class (scaled), GB/s
    block_bytes: int           # atomic block size
    flag_bytes: int            # TFF flag field inside a block
    port_of_hop: np.ndarray    # [C] port index of each hop class (equal bandwidth: one link)
    staging_rows: int = 2      # rows one worker keeps in flight (the topology's hardware fact)
    uplink_hop: int = -1       # hop class that crosses a group's uplink (-1: none)
    group_of_rank: np.ndarray | None = None   # [P] uplink group of each rank
    uplink_bw_GBps: float = float("inf")      # one group's uplink (and downlink), GB/s

    @staticmethod
    def of(topology, params: CostParams) -> Fabric:
        c = topology.num_hop_classes
        lat = np.array([topology.hop_latency_ns(h) for h in range(c)], dtype=np.float64)
        bw = np.array([topology.hop_bandwidth_GBps(h) for h in range(c)], dtype=np.float64)
        up_hop, groups, up_bw = -1, np.zeros(topology.num_ranks, dtype=np.int64), math.inf
        if len(topology.tiers) >= 3 and params.uplink_bw_scale > 0:
            inner = topology.tiers[-2]           # the group whose uplink the outermost tier uses
            up_hop = len(topology.tiers)
            groups = inner.group_ids(topology.num_ranks)
            up_bw = (params.uplink_bw_scale * inner.ranks_per_group
                     * topology.tiers[-1].bandwidth_GBps * params.port_bw_scale)
        return Fabric(
            name=topology.name, num_ranks=topology.num_ranks,
            workers_per_rank=topology.workers_per_rank,
            hop=np.asarray(topology.hop_matrix(), dtype=np.int64),
            latency_us=lat * 1e-3 * params.latency_scale,
            port_bw_GBps=bw * params.port_bw_scale,
            block_bytes=int(topology.atomic_block_bytes), flag_bytes=int(topology.flag_bytes),
            port_of_hop=_ports(bw), staging_rows=int(topology.staging_rows),
            uplink_hop=up_hop, group_of_rank=groups, uplink_bw_GBps=up_bw)

    def uplink_us(self, wire_bytes: float, hop: np.ndarray) -> np.ndarray:
        """Time a group's uplink needs to pass `wire_bytes` (0 for hops that do not cross)."""
        if self.uplink_hop < 0 or math.isinf(self.uplink_bw_GBps):
            return np.zeros(np.shape(hop))
        return np.where(hop == self.uplink_hop, wire_bytes / (self.uplink_bw_GBps * 1e3), 0.0)

    def service_us(self, wire_bytes: float, hop: np.ndarray) -> np.ndarray:
        """Time one port needs to pass `wire_bytes` toward hop class `hop` (0 if infinite)."""
        bw = self.port_bw_GBps[hop]
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(np.isinf(bw), 0.0, wire_bytes / (bw * 1e3))
        return np.where(hop == 0, 0.0, t)


def wire_layout(row_bytes: int, sync: str, block_bytes: int, flag_bytes: int
                ) -> tuple[int, int]:
    """`(blocks, wire_bytes)` of one row under a sync variant.

    tff puts a `flag_bytes` flag into every block, so a row needs
    ceil(row / (block - flag)) blocks and carries one flag per block on the wire; the other
    variants send the payload as is (blocks only count the per-block receiver work).
    """
    if sync == "tff":
        payload = block_bytes - flag_bytes
        if payload <= 0:
            raise ValueError(f"flag_bytes={flag_bytes} must be < atomic_block_bytes={block_bytes}")
        blocks = max(1, math.ceil(row_bytes / payload))
        return blocks, row_bytes + blocks * flag_bytes
    return max(1, math.ceil(row_bytes / block_bytes)), row_bytes


def time_us(nbytes: float, bw_GBps: float) -> float:
    """`nbytes` at `bw_GBps` in microseconds (0 at infinite bandwidth)."""
    return 0.0 if math.isinf(bw_GBps) else nbytes / (bw_GBps * 1e3)


def _ports(bw: np.ndarray) -> np.ndarray:
    """Remote hop classes of equal bandwidth share one port (one physical link, as the UB
    fabric of cm384); classes of different bandwidth use different links (NVLink vs IB).
    Class 0 (local) uses no port."""
    out = np.zeros(bw.size, dtype=np.int64)
    seen: list[float] = []
    for h in range(1, bw.size):
        if bw[h] not in seen:
            seen.append(float(bw[h]))
        out[h] = seen.index(float(bw[h]))
    return out
