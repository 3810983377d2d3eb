"""What one cluster prediction is run on: `ClusterConfig` (the CLI is generated from it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from ubep.options import check_choice, check_positive_int
from ubep.plan.topology import NIC_LATENCY_US, PRESETS, Topology
from ubep.sim.workload import ROUTINGS

#: how rows cross the network (see `ubep.sim.cluster.policy`)
POLICIES = ("flat", "hybrid", "per-expert")
OPS = ("dispatch", "combine")
#: the default sweep of the issue: 2-32 hosts of 8 ranks
HOSTS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ClusterConfig:
    """A cluster (hosts x ranks, NICs, the inside of a host) and one workload per rank."""

    hosts: int = field(default=2, metadata={"help": "hosts"})
    ranks_per_host: int = field(default=8, metadata={"help": "ranks on every host"})
    nic_gbps: float = field(default=400.0, metadata={
        "help": "one NIC's line rate, Gb/s (one NIC per rank unless nics_per_host)"})
    nic_latency_us: float = field(default=NIC_LATENCY_US, metadata={
        "help": "one-way latency through the NICs and the switch, us (nominal)"})
    nics_per_host: int = field(default=0, metadata={
        "help": "NICs per host (0: one per rank, as DeepEP's H800 nodes)"})
    intra_host: str = field(default="cluster", metadata={
        "help": "the inside of a host: a preset or TOML file; a cluster's first host "
                "('cluster': 8 GPUs on 160 GB/s NVLink), 'host': this machine"})
    tokens_per_rank: int = field(default=128, metadata={"help": "tokens per rank (batch)"})
    hidden: int = field(default=7168, metadata={"help": "elements per token row"})
    top_k: int = field(default=8, metadata={"help": "experts per token"})
    num_experts: int = field(default=256, metadata={"help": "global experts"})
    bytes_per_element: int = field(default=2, metadata={
        "help": "bytes per element of dispatched rows (2: bf16)"})
    combine_bytes_per_element: int = field(default=0, metadata={
        "help": "bytes per element of combine's partial rows (0: as dispatch; the output "
                "dtype, as DeepEP and ubep's torch backend send them)"})
    meta_bytes_per_row: int = field(default=-1, metadata={
        "help": "routing bytes sent with each dispatched row (-1: ubep's torch backend's "
                "words, 4 * (1 + 2 * top_k): token index, expert ids, weights)"})
    header_bytes: int = field(default=16, metadata={
        "help": "bytes of the count header dispatch sends each peer before the rows"})
    routing: str = field(default="uniform", metadata={"help": "uniform | hot"})
    hot_experts: int = field(default=0, metadata={"help": "experts made hot (routing skew)"})
    max_hosts_per_token: int = field(default=0, metadata={
        "help": "node-limited routing: each token's experts on at most this many hosts "
                "(0: no limit)"})
    seed: int = field(default=0, metadata={"help": "routing seed"})

    def __post_init__(self) -> None:
        for name in ("hosts", "ranks_per_host", "tokens_per_rank", "hidden", "top_k",
                     "num_experts", "bytes_per_element", "header_bytes"):
            check_positive_int(name, getattr(self, name))
        for name in ("nics_per_host", "combine_bytes_per_element", "hot_experts",
                     "max_hosts_per_token", "seed"):
            check_positive_int(name, getattr(self, name), minimum=0)
        check_positive_int("meta_bytes_per_row", self.meta_bytes_per_row, minimum=-1)
        for name in ("nic_gbps", "nic_latency_us"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive number")
        check_choice("routing", self.routing, ROUTINGS)
        ranks = self.hosts * self.ranks_per_host
        if self.num_experts % ranks:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of the "
                             f"{ranks} ranks (hosts * ranks_per_host)")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be <= num_experts={self.num_experts}")
        if self.max_hosts_per_token > self.hosts:
            raise ValueError(f"max_hosts_per_token={self.max_hosts_per_token} must be <= "
                             f"hosts={self.hosts}")
        if not isinstance(self.intra_host, str) or not self.intra_host:
            raise ValueError(f"intra_host={self.intra_host!r} must be a preset name or a "
                             f"TOML path")

    @property
    def num_ranks(self) -> int:
        return self.hosts * self.ranks_per_host

    @property
    def row_bytes(self) -> int:
        """Bytes of one dispatched row."""
        return self.hidden * self.bytes_per_element

    @property
    def partial_bytes(self) -> int:
        """Bytes of one combine partial row."""
        return self.hidden * (self.combine_bytes_per_element or self.bytes_per_element)

    @property
    def meta_bytes(self) -> int:
        """Routing bytes that travel with each dispatched row."""
        return 4 * (1 + 2 * self.top_k) if self.meta_bytes_per_row < 0 else \
            self.meta_bytes_per_row

    def topology(self) -> Topology:
        """The modelled cluster: `Topology.cluster` around `intra_host`."""
        spec = self.intra_host
        inside: Topology | str = spec
        if spec in PRESETS and spec != "host":      # "host": this machine, per host's ranks
            inside = Topology.preset(spec)
        elif spec != "host":
            inside = Topology.from_toml(spec)
        if isinstance(inside, Topology) and inside.network_hop_class is not None:
            inside = inside.inside_host(0)
        return Topology.cluster(self.hosts, self.ranks_per_host, nic_gbps=self.nic_gbps,
                                nic_latency_us=self.nic_latency_us,
                                nics_per_host=self.nics_per_host or None, intra_host=inside,
                                name=f"cluster-{self.hosts}x{self.ranks_per_host}")

    def with_hosts(self, hosts: int) -> ClusterConfig:
        return replace(self, hosts=hosts)

    @staticmethod
    def help() -> dict[str, str]:
        return {f.name: f.metadata["help"] for f in fields(ClusterConfig)}

    def to_dict(self) -> dict:
        return asdict(self)
