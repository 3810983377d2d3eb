"""`simulate()`: build the routing, plan every rank with `ubep.plan`, run the engine.

`prepare()` does the parts that do not depend on the cost constants (routing, plans, the
send table), so calibration and sweeps plan once and run the engine many times.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from ubep.options import MODES, SCHEDULES, SYNCS, check_choice, check_positive_int
from ubep.plan import make_plan
from ubep.sim import engine
from ubep.sim.fabric import Fabric
from ubep.sim.metrics import SimResult
from ubep.sim.params import CostParams, calibrated
from ubep.sim.workload import ROUTINGS, make_topk

OPS = ("dispatch", "combine")


@dataclass(frozen=True)
class SimConfig:
    """One simulated operation: workload and mechanism choices (the CLI is built from it)."""

    tokens_per_rank: int = field(default=128, metadata={"help": "tokens per rank (batch)"})
    hidden: int = field(default=7168, metadata={"help": "elements per token row"})
    top_k: int = field(default=8, metadata={"help": "experts per token"})
    num_experts: int = field(default=0, metadata={"help": "global experts (0: one per rank)"})
    bytes_per_element: int = field(default=2, metadata={"help": "bytes per element"})
    mode: str = field(default="ubep", metadata={"help": "ubep (decomposed) | bsp (baseline)"})
    sync: str = field(default="tff", metadata={"help": "sw | tff | dc | sp (ubep only)"})
    schedule: str = field(default="hierarchical",
                          metadata={"help": "static | balanced | hierarchical"})
    workers: int = field(default=0, metadata={"help": "workers per rank (0: the topology's)"})
    count_workers: int = field(default=0, metadata={
        "help": "count workers (0: the cost model's choice, Eq. 4 on these constants)"})
    send_chunk: int = field(default=0, metadata={
        "help": "hierarchical: sends per interleaving step of a worker's hop classes (0: the "
                "cost model's choice: the staging depth when a worker's latency bounds the "
                "sending, else 1)"})
    op: str = field(default="dispatch", metadata={"help": "dispatch | combine"})
    direct: bool = field(default=False, metadata={
        "help": "ubep: the one-copy variant (counts first, rows straight to place)"})
    routing: str = field(default="uniform", metadata={"help": "uniform | hot"})
    hot_experts: int = field(default=0, metadata={"help": "experts made hot (routing skew)"})
    hot_weight: float = field(default=16.0, metadata={
        "help": "a hot expert is this many times likelier to be picked than another"})
    seed: int = field(default=0, metadata={"help": "routing seed"})

    def __post_init__(self) -> None:
        for name in ("tokens_per_rank", "hidden", "top_k", "bytes_per_element"):
            check_positive_int(name, getattr(self, name))
        for name in ("num_experts", "workers", "count_workers", "send_chunk", "hot_experts",
                     "seed"):
            check_positive_int(name, getattr(self, name), minimum=0)
        check_choice("mode", self.mode, MODES)
        check_choice("sync", self.sync, SYNCS)
        check_choice("schedule", self.schedule, SCHEDULES)
        check_choice("op", self.op, OPS)
        check_choice("routing", self.routing, ROUTINGS)
        if not isinstance(self.direct, bool):
            raise TypeError(f"direct must be a bool, got {type(self.direct).__name__}")
        if self.direct and self.mode != "ubep":
            raise ValueError("direct=True needs mode='ubep' (the counts go first)")
        if not (isinstance(self.hot_weight, (int, float)) and self.hot_weight >= 1):
            raise ValueError(f"hot_weight={self.hot_weight!r} must be a number >= 1")

    @staticmethod
    def help() -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in fields(SimConfig)}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Prepared:
    """Routing, plans and the send table of one config on one topology."""

    config: SimConfig
    topology: object
    num_experts: int
    workers: int
    count_workers: int
    topk: np.ndarray
    plans: list
    plan_s: float
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    def table(self, fab: Fabric) -> engine.SendTable:
        """The send table (depends only on the plans and the hop matrix; kept)."""
        if "t" not in self._tables:
            t = engine.table_from_plans(self.plans, fab, self.workers)
            if self.config.op == "combine":
                t = engine.combine_table(t, fab)
            self._tables["t"] = t
        return self._tables["t"]


def resolve_topology(topology, ranks: int | None = None):
    """A `ubep.Topology` from a preset name, a TOML path or a Topology (rescaled to `ranks`)."""
    from ubep.plan.topology import Topology

    if isinstance(topology, Topology):
        return topology if ranks is None else topology.with_ranks(ranks)
    if isinstance(topology, str) and ranks is None:
        from ubep.plan.topology import PRESETS
        if topology in PRESETS:
            return Topology.preset(topology)
        return Topology.from_toml(topology)
    if ranks is None:
        raise TypeError(f"topology must be a preset name, a TOML path or a Topology, "
                        f"got {type(topology).__name__}")
    return Topology.resolve(topology, ranks)


def model_count_workers(topology, config: SimConfig, num_experts: int, workers: int,
                        params: CostParams | None = None) -> int:
    """The count-worker choice of `ubep.plan.costmodel` (Eq. 4) with the unit costs these
    constants imply on this fabric: the same formulas the engine runs for the count path."""
    from ubep.plan.costmodel import choose_count_workers

    params = params or calibrated(topology.name)
    fab = Fabric.of(topology, params)
    row_bytes = config.hidden * config.bytes_per_element
    _, wire = engine.wire_bytes_of(row_bytes, "ubep", config.sync, fab)
    return choose_count_workers(workers, num_experts, config.top_k, config.tokens_per_rank,
                                ranks=topology.num_ranks,
                                costs=engine.count_costs(params, fab, wire, row_bytes,
                                                         num_experts // topology.num_ranks))


def model_send_chunk(topology, config: SimConfig, num_experts: int, token_workers: int,
                     params: CostParams | None = None) -> int:
    """The hierarchical schedule's interleaving step on this fabric, from the terms of
    Eq. 4's `t_token` on these constants: the topology's staging depth when the token
    workers' staging pace (hop latency) bounds the sending — keep each round of a worker's
    staging ring to one hop class — else 1, when the rank's port does — spread every tier's
    load evenly over time."""
    params = params or calibrated(topology.name)
    fab = Fabric.of(topology, params)
    row_bytes = config.hidden * config.bytes_per_element
    _, wire = engine.wire_bytes_of(row_bytes, config.mode, config.sync, fab)
    cc = engine.count_costs(params, fab, wire, row_bytes, num_experts // topology.num_ranks)
    latency_bound = cc.row_us / max(token_workers, 1) > cc.port_row_us
    return int(topology.staging_rows) if latency_bound else 1


def prepare(topology, config: SimConfig, *, ranks: int | None = None,
            params: CostParams | None = None, topk: np.ndarray | None = None) -> Prepared:
    """Route and plan every rank. Only the count-worker choice and the hierarchical send
    chunk (when `config.count_workers` / `config.send_chunk` is 0) depend on the cost
    constants `params` (default: the calibrated ones). `topk`: a given routing,
    `[ranks, tokens_per_rank, top_k]` expert ids, planned instead of drawing one from
    `config` (the host model runs the bench's own)."""
    topo = resolve_topology(topology, ranks)
    P = topo.num_ranks
    workers = config.workers or topo.workers_per_rank
    topo = topo.with_workers(workers)
    E = config.num_experts or P
    if E % P:
        raise ValueError(f"num_experts={E} must be a multiple of the rank count {P}")
    if config.top_k > E:
        raise ValueError(f"top_k={config.top_k} must be <= num_experts={E}")
    if config.count_workers >= workers:
        raise ValueError(f"count_workers={config.count_workers} must be < workers={workers}")
    if topk is None:
        topk = make_topk(P, config.tokens_per_rank, config.top_k, E, routing=config.routing,
                         hot_experts=config.hot_experts, hot_weight=config.hot_weight,
                         seed=config.seed)
    else:
        topk = np.asarray(topk)
        want = (P, config.tokens_per_rank, config.top_k)
        if topk.shape != want or not np.issubdtype(topk.dtype, np.integer):
            raise ValueError(f"topk must be an integer array of shape {want} (ranks, "
                             f"tokens_per_rank, top_k), got {topk.dtype} {topk.shape}")
        if topk.size and (topk.min() < 0 or topk.max() >= E):
            raise ValueError(f"topk must hold expert ids in [0, num_experts={E})")
    nc = config.count_workers
    if config.mode == "ubep" and nc == 0:
        nc = model_count_workers(topo, config, E, workers, params)
    chunk = config.send_chunk
    if chunk == 0:
        chunk = 1 if config.schedule != "hierarchical" else model_send_chunk(
            topo, config, E, workers - (nc if config.mode == "ubep" else 0), params)
    t = time.perf_counter()
    plans = [make_plan(topk[r], topology=topo, rank=r, num_experts=E, workers=workers,
                       count_workers=(nc or None) if config.mode == "ubep" else None,
                       schedule=config.schedule, mode=config.mode, send_chunk=chunk)
             for r in range(P)]
    plan_s = time.perf_counter() - t
    nc = int(plans[0].count_workers) if config.mode == "ubep" else 0
    return Prepared(config=config, topology=topo, num_experts=E, workers=workers,
                    count_workers=nc, topk=topk, plans=plans, plan_s=plan_s)


def execute(prep: Prepared, params: CostParams | None = None, *, exact: bool = False,
            cache: dict | None = None) -> SimResult:
    """Run the engine on a prepared operation with cost constants `params`
    (default: the calibrated ones). `cache`: see `engine.send_stage` (calibration)."""
    params = params or calibrated(prep.topology.name)
    c = prep.config
    t = time.perf_counter()
    fab = Fabric.of(prep.topology, params)
    table = prep.table(fab)
    row_bytes = c.hidden * c.bytes_per_element
    out = engine.run(c.op, c.mode, c.sync, table, fab, params, row_bytes=row_bytes,
                     tokens_per_rank=c.tokens_per_rank, top_k=c.top_k,
                     num_experts=prep.num_experts, count_workers=prep.count_workers,
                     exact=exact, cache=cache, seed=c.seed, direct=c.direct)
    out.extra.update(src=table.src, dst=table.dst)
    # what each rank's ingress port must take in, and the time that takes at best
    remote = table.src != table.dst
    ingress = np.bincount(table.dst[remote], minlength=fab.num_ranks) * out.wire_bytes_per_row
    hops = np.unique(table.hop[remote])
    port = float(fab.port_bw_GBps[hops].min()) if hops.size else float("inf")
    out.extra.update(ingress_bytes=ingress,
                     ingress_floor_us=ingress / (port * 1e3) if np.isfinite(port)
                     else np.zeros(fab.num_ranks))
    # the same for the second switch tier: what each group's uplink sends and its downlink
    # takes in (rows of the outermost hop class), and the time that takes at best
    up_floor = np.zeros(0)
    if fab.uplink_hop >= 0 and np.isfinite(fab.uplink_bw_GBps):
        far = table.hop == fab.uplink_hop
        groups = int(fab.group_of_rank.max()) + 1
        row_us = out.wire_bytes_per_row / (fab.uplink_bw_GBps * 1e3)
        up_floor = np.maximum(
            np.bincount(fab.group_of_rank[table.src[far]], minlength=groups),
            np.bincount(fab.group_of_rank[table.dst[far]], minlength=groups)) * row_us
    out.extra.update(uplink_floor_us=up_floor)
    P = fab.num_ranks
    payload = int(table.src.size) * row_bytes
    wire = int(table.src.size) * out.wire_bytes_per_row
    lat = out.latency_us
    bw = (payload / P) / (lat * 1e3) if lat > 0 else float("inf")
    return SimResult(config=c, topology=fab.name, num_ranks=P, workers=prep.workers,
                     latency_us=lat, bandwidth_GBps=bw, phases_us=out.phases_us,
                     payload_bytes=payload, wire_bytes=wire,
                     payload_efficiency=payload / wire if wire else 1.0,
                     count_workers=prep.count_workers, engine=out, plan_s=prep.plan_s,
                     engine_s=time.perf_counter() - t)


def simulate(topology, *, tokens_per_rank: int = 128, hidden: int = 7168, top_k: int = 8,
             num_experts: int = 0, bytes_per_element: int = 2, mode: str = "ubep",
             sync: str = "tff", schedule: str = "hierarchical", workers: int | None = None,
             count_workers: int | None = None, op: str = "dispatch", routing: str = "uniform",
             hot_experts: int = 0, hot_weight: float = 16.0, seed: int = 0,
             direct: bool = False, ranks: int | None = None,
             params: CostParams | None = None, exact: bool = False) -> SimResult:
    """Simulate one dispatch or combine of every rank on a modelled fabric.

    Arguments:
        topology: a preset name ("cm384", "nvl72", "nvl576", "ib-cluster"), a TOML path or a
            `ubep.Topology`; `ranks` rescales it (default: the preset's size).
        tokens_per_rank, hidden, top_k, bytes_per_element: the workload per rank.
        num_experts: global experts, a multiple of the rank count (0: one per rank).
        mode: "ubep" | "bsp"; sync: "sw" | "tff" | "dc" | "sp" (ubep; bsp has its own flag
            phase); schedule: "static" | "balanced" | "hierarchical".
        workers, count_workers: per rank (None: the topology's / the cost model's choice).
        op: "dispatch" | "combine". routing: "uniform" | "hot" with `hot_experts` hot ones,
            each `hot_weight` times likelier than another expert. direct: the shm runtime's
            one-copy variant (ubep; counts first, rows straight to their place).
        params: cost constants (default: the calibrated ones). exact: use the event engine.
    Returns:
        `SimResult` with `latency_us`, `bandwidth_GBps`, `phases_us`, per-rank `stats(r)`.
    """
    hot = routing == "hot" or hot_experts > 0
    cfg = SimConfig(tokens_per_rank=tokens_per_rank, hidden=hidden, top_k=top_k,
                    num_experts=num_experts, bytes_per_element=bytes_per_element, mode=mode,
                    sync=sync, schedule=schedule, workers=workers or 0,
                    count_workers=count_workers or 0, op=op, routing="hot" if hot else routing,
                    hot_experts=hot_experts, hot_weight=hot_weight, seed=seed, direct=direct)
    return execute(prepare(topology, cfg, ranks=ranks, params=params), params, exact=exact)


def with_config(prep: Prepared, **changes) -> SimConfig:
    return replace(prep.config, **changes)
