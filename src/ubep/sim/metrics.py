"""What a simulation returns: `SimResult` (latency, bandwidth, phases, timelines) and the
per-rank `ubep.Stats` every executor returns, built on demand from the engine's arrays."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ubep.sim.engine import EngineOutput
from ubep.stats import Interval, Stats


@dataclass(frozen=True)
class SimResult:
    """One simulated dispatch or combine over all ranks.

    Attributes:
        config: the `SimConfig` that ran.
        topology: name of the fabric; `num_ranks`, `workers` as simulated.
        latency_us: until the last rank finished (max over ranks).
        bandwidth_GBps: payload bytes per rank / latency (the paper's "effective bandwidth").
        phases_us: phase name -> duration on the slowest rank (ubep phases overlap, so they
            need not sum to the latency).
        payload_bytes: row bytes moved, all ranks; `wire_bytes` with sync overhead.
        payload_efficiency: payload / wire bytes.
        count_workers: count workers per rank (0 for bsp).
        engine: the engine's raw arrays (per-row trace, per-worker intervals).
    """

    config: object
    topology: str
    num_ranks: int
    workers: int
    latency_us: float
    bandwidth_GBps: float
    phases_us: dict[str, float]
    payload_bytes: int
    wire_bytes: int
    payload_efficiency: float
    count_workers: int
    engine: EngineOutput = field(repr=False)
    plan_s: float = 0.0
    engine_s: float = 0.0

    @property
    def phases(self) -> dict[str, float]:
        """Alias of `phases_us`."""
        return self.phases_us

    @property
    def ingress_bytes(self) -> np.ndarray:
        """`[P]` remote bytes each rank receives (wire bytes, sync overhead included)."""
        return self.engine.extra["ingress_bytes"]

    @property
    def ingress_floor_us(self) -> float:
        """The largest per-rank ingress divided by that rank's port bandwidth: no schedule
        can finish the dispatch's sending sooner (a skewed routing raises it)."""
        return float(np.max(self.engine.extra["ingress_floor_us"], initial=0.0))

    @property
    def uplink_floor_us(self) -> float:
        """The second switch tier's floor: the largest number of rows a group's uplink sends
        or its downlink takes in (outermost hop class) times a row's time there (0 when the
        fabric models no uplink). Like the ingress floor, no schedule finishes sooner."""
        return float(np.max(self.engine.extra.get("uplink_floor_us", np.zeros(0)),
                            initial=0.0))

    def worker_intervals(self, rank: int) -> list[Interval]:
        """Busy/wait intervals of every worker of `rank`, by worker then start time."""
        e = self.engine
        sel = np.flatnonzero(e.iv_rank == rank)
        sel = sel[np.lexsort((e.iv_start[sel], e.iv_worker[sel]))]
        return [Interval(rank=int(rank), worker=int(e.iv_worker[i]), name=str(e.iv_name[i]),
                         start_us=float(e.iv_start[i]), end_us=float(e.iv_end[i]),
                         kind="busy" if e.iv_busy[i] else "wait") for i in sel]

    def stats(self, rank: int) -> Stats:
        """The `ubep.Stats` of one rank, as the real runtimes report them."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank} is not in [0, {self.num_ranks})")
        e, c = self.engine, self.config
        sent = int(np.count_nonzero(self._src == rank)) * self._row_bytes
        recv = int(np.count_nonzero(self._dst == rank)) * self._row_bytes
        return Stats(op=c.op, backend="sim", mode=c.mode, sync=c.sync if c.mode == "ubep"
                     else "sw", schedule=c.schedule, rank=rank,
                     total_us=float(e.rank_end_us[rank]),
                     phases_us={k: float(v[rank]) for k, v in e.rank_phase_us.items()},
                     intervals=self.worker_intervals(rank), bytes_sent=sent, bytes_recv=recv,
                     payload_efficiency=self.payload_efficiency,
                     extra={"topology": self.topology, "count_workers": self.count_workers})

    def all_stats(self) -> list[Stats]:
        return [self.stats(r) for r in range(self.num_ranks)]

    @cached_property
    def _row_bytes(self) -> int:
        return self.config.hidden * self.config.bytes_per_element

    @property
    def _src(self) -> np.ndarray:
        return self.engine.extra["src"]

    @property
    def _dst(self) -> np.ndarray:
        return self.engine.extra["dst"]

    def summary(self) -> dict[str, object]:
        """Flat row for tables and CSV files."""
        c = self.config
        return {"topology": self.topology, "ranks": self.num_ranks, "op": c.op, "mode": c.mode,
                "sync": c.sync, "schedule": c.schedule, "tokens_per_rank": c.tokens_per_rank,
                "hidden": c.hidden, "top_k": c.top_k, "num_experts": c.num_experts,
                "workers": self.workers, "count_workers": self.count_workers,
                "latency_us": round(self.latency_us, 3),
                "bandwidth_GBps": round(self.bandwidth_GBps, 3),
                "payload_efficiency": round(self.payload_efficiency, 4),
                "max_ingress_bytes": int(np.max(self.ingress_bytes, initial=0)),
                "ingress_floor_us": round(self.ingress_floor_us, 3),
                "uplink_floor_us": round(self.uplink_floor_us, 3),
                **{f"phase_{k}_us": round(v, 3) for k, v in self.phases_us.items()}}
