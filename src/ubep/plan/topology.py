"""The fabric model every planner, executor and the simulator share: ranks, tiers, hop classes.

A topology is a tree of tiers, innermost first. Tier i groups ranks in blocks of
`ranks_per_group` consecutive ranks (rank r is in group `r // ranks_per_group`), or in the
explicit `groups` it lists (uneven, non-consecutive: the hosts a job really got); the
outermost tier joins every rank. Two distinct ranks are in hop class `i + 1` for the
innermost tier i whose group holds both; hop class 0 is the rank itself (a local store).
Each hop class has a latency and a per-rank bandwidth.

Hosts: a cluster's outermost tier is named "other host" (`NETWORK_TIER`): its hop class is
the network (each rank's share of its host's NICs), and the groups of the tier inside it are
the hosts (shared-memory domains). `Topology.cluster` and `Topology.from_hosts` build one
around the inside of a host (this machine by default); `topology.hosts` lists each host's
ranks (one host on a fabric without that tier).

Files are TOML (see `plan/presets/*.toml`); a file gives `[[tiers]]`, or a cluster's fields
(`hosts`, `ranks_per_host`, `nic_gbps`, `nic_latency_us`, `[intra_host]`).
`Topology.preset(name, ranks=n)` scales a preset to n ranks laid out as on the real machine
(the outermost tier grows or shrinks).
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

PRESETS = ("cm384", "nvl72", "nvl576", "ib-cluster", "cluster", "host")

#: the name of the tier (and hop class) that joins hosts over the network
NETWORK_TIER = "other host"
#: a NIC's one-way latency when none is given: nominal, not calibrated (as ib-cluster's)
NIC_LATENCY_US = 4.0

_TOP_KEYS = {
    "name": "str", "description": "str", "num_ranks": "int", "workers_per_rank": "int",
    "atomic_block_bytes": "int", "flag_bytes": "int", "local_latency_ns": "float",
    "local_bandwidth_GBps": "float", "tiers": "list", "staging_rows": "int",
}
_TOP_REQUIRED = ("name", "num_ranks", "workers_per_rank", "atomic_block_bytes", "flag_bytes",
                 "local_latency_ns", "local_bandwidth_GBps", "tiers")
_TIER_KEYS = {"name": "str", "ranks_per_group": "int", "groups": "groups",
              "latency_ns": "float", "bandwidth_GBps": "float"}
_TIER_REQUIRED = ("name", "latency_ns", "bandwidth_GBps")


@dataclass(frozen=True)
class Tier:
    """One level of the fabric: groups of ranks that reach each other here.

    Attributes:
        name: e.g. "npu", "board", "pod"; "other host" (`NETWORK_TIER`) for the network
            between hosts.
        ranks_per_group: ranks in one group of this tier (the outermost tier: all ranks);
            with `groups`, the largest group's size.
        latency_ns: one store's access latency between two ranks whose nearest common
            group is of this tier.
        bandwidth_GBps: per-rank bandwidth toward such ranks, GB/s (1e9 bytes per second).
        groups: None: blocks of `ranks_per_group` consecutive ranks (rank r in group
            `r // ranks_per_group`). Else the ranks of each group (each rank in exactly one;
            sizes may differ; a group's ranks are kept ascending, the groups in their order).
            `Tier.of_groups` fills `ranks_per_group`.
    """

    name: str
    ranks_per_group: int
    latency_ns: float
    bandwidth_GBps: float
    groups: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.groups is not None:
            object.__setattr__(self, "groups", normal_groups(self.groups, f"tier {self.name!r}"))

    @staticmethod
    def of_groups(name: str, groups: Sequence[Sequence[int]], latency_ns: float,
                  bandwidth_GBps: float) -> Tier:
        """A tier of explicit groups; consecutive equal blocks become a plain block tier."""
        g = normal_groups(groups, f"tier {name!r}")
        size = max(len(x) for x in g)
        n = sum(len(x) for x in g)
        blocks = tuple(tuple(range(i, min(i + size, n))) for i in range(0, n, size))
        return Tier(name, size, latency_ns, bandwidth_GBps, None if g == blocks else g)

    def group_ids(self, num_ranks: int) -> np.ndarray:
        """`[num_ranks]` int64: the group index of every rank."""
        if self.groups is None:
            return np.arange(num_ranks, dtype=np.int64) // self.ranks_per_group
        ids = np.full(num_ranks, -1, dtype=np.int64)
        for i, g in enumerate(self.groups):
            ids[list(g)] = i
        return ids


@dataclass(frozen=True)
class Topology:
    """Ranks, workers per rank and the tier tree of an EP fabric; gives every pair's hop class.

    Attributes:
        name, description: labels.
        num_ranks: ranks (EP processes / dies / GPUs).
        workers_per_rank: cores (workers) one rank may use for a dispatch.
        atomic_block_bytes: largest store a remote reader sees whole (cm384: 512; host: a
            64 B cache line).
        flag_bytes: size of the token-flag-fusion flag field inside a block (cm384 32, host 8).
        tiers: `Tier`s, innermost first; the last one joins every rank.
        local_latency_ns, local_bandwidth_GBps: hop class 0, a store into the rank's own memory.
        staging_rows: rows one worker keeps in flight (its staging buffers): a row is copied
            into a buffer slot, stored to its destination, and the slot is free again once
            the store completed (hop latency plus serialization). cm384: 2, the CANN dispatch
            kernel's double-buffered unified buffer. A property of the kernel on that
            hardware, not a fitted constant (the simulator reads it).
    """

    name: str
    num_ranks: int
    workers_per_rank: int
    atomic_block_bytes: int
    flag_bytes: int
    tiers: tuple[Tier, ...]
    local_latency_ns: float
    local_bandwidth_GBps: float
    description: str = field(default="", compare=False)
    staging_rows: int = 2

    def __post_init__(self) -> None:
        _check_topology(self, where=f"topology {self.name!r}")

    def __getstate__(self) -> dict:
        # derived caches (hop matrix, planner layouts) are rebuilt on demand, not shipped
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    # -- hop classes ------------------------------------------------------------------
    @property
    def num_hop_classes(self) -> int:
        """Hop classes the model defines: local + one per tier (some may be unused)."""
        return 1 + len(self.tiers)

    def hop_class(self, src: int, dst: int) -> int:
        """0 if `src == dst`, else 1 + the index of the innermost tier grouping both."""
        for name, r in (("src", src), ("dst", dst)):
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise TypeError(f"{name} must be an int rank, got {type(r).__name__}")
            if not 0 <= r < self.num_ranks:
                raise ValueError(f"{name}={r} is not a rank of {self.name!r} "
                                 f"(0 <= rank < {self.num_ranks})")
        if src == dst:
            return 0
        for i, ids in enumerate(self._group_ids):
            if ids[src] == ids[dst]:
                return i + 1
        return len(self.tiers)  # unreachable: the outermost tier joins every rank

    def hop_matrix(self) -> np.ndarray:
        """`[num_ranks, num_ranks]` int64, read-only: the hop class of every (src, dst) pair."""
        return self._hop_matrix

    @cached_property
    def _hop_matrix(self) -> np.ndarray:
        hops = np.full((self.num_ranks, self.num_ranks), len(self.tiers), dtype=np.int64)
        for i in range(len(self.tiers) - 2, -1, -1):  # inner tiers override outer ones
            group = self._group_ids[i]
            hops[group[:, None] == group[None, :]] = i + 1
        np.fill_diagonal(hops, 0)
        hops.setflags(write=False)
        return hops

    def tier_groups(self, tier: int) -> tuple[tuple[int, ...], ...]:
        """The ranks of every group of `tiers[tier]`, groups in order, ranks ascending."""
        _check_index("tier", tier, len(self.tiers))
        t = self.tiers[tier]
        if t.groups is not None:
            return t.groups
        return tuple(tuple(range(i, min(i + t.ranks_per_group, self.num_ranks)))
                     for i in range(0, self.num_ranks, t.ranks_per_group))

    @cached_property
    def _group_ids(self) -> tuple[np.ndarray, ...]:
        out = []
        for t in self.tiers:
            ids = t.group_ids(self.num_ranks)
            ids.setflags(write=False)
            out.append(ids)
        return tuple(out)

    # -- hosts --------------------------------------------------------------------------
    @property
    def network_hop_class(self) -> int | None:
        """The hop class "other host" (the network between hosts), or None on one host."""
        return len(self.tiers) if self.tiers[-1].name == NETWORK_TIER else None

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each host (shared-memory domain), ascending; hosts in order.

        A cluster's hosts are the groups of the tier inside "other host" (every rank its own
        host when that tier is the only one); a fabric without it is one host.
        """
        return self._hosts

    @cached_property
    def _hosts(self) -> tuple[tuple[int, ...], ...]:
        if self.network_hop_class is None:
            return (tuple(range(self.num_ranks)),)
        if len(self.tiers) == 1:
            return tuple((r,) for r in range(self.num_ranks))
        return self.tier_groups(len(self.tiers) - 2)

    @property
    def num_hosts(self) -> int:
        """Hosts (shared-memory domains): `len(hosts)`."""
        return len(self._hosts)

    def host_of(self, rank: int) -> int:
        """The index into `hosts` of the host that holds `rank`."""
        _check_index("rank", rank, self.num_ranks)
        return int(self._host_ids[rank])

    @cached_property
    def _host_ids(self) -> np.ndarray:
        ids = np.empty(self.num_ranks, dtype=np.int64)
        for h, g in enumerate(self._hosts):
            ids[list(g)] = h
        ids.setflags(write=False)
        return ids

    def host_ids(self) -> np.ndarray:
        """`[num_ranks]` int64, read-only: `host_of` of every rank."""
        return self._host_ids

    def inside_host(self, host: int = 0) -> Topology:
        """The topology of one host alone: its ranks renumbered 0..n-1 in ascending order,
        the tiers inside "other host" (the host tier becomes the outermost). A fabric
        without hosts returns itself."""
        _check_index("host", host, self.num_hosts)
        if self.network_hop_class is None:
            return self
        ranks = self._hosts[host]
        local = {r: i for i, r in enumerate(ranks)}
        tiers = []
        for i, t in enumerate(self.tiers[:-1]):
            if i == len(self.tiers) - 2:
                tiers.append(Tier(t.name, len(ranks), t.latency_ns, t.bandwidth_GBps))
                continue
            groups = [[local[r] for r in g if r in local] for g in self.tier_groups(i)]
            tiers.append(Tier.of_groups(t.name, [g for g in groups if g], t.latency_ns,
                                        t.bandwidth_GBps))
        if not tiers:  # one rank per host
            tiers = [Tier("host", 1, self.local_latency_ns, self.local_bandwidth_GBps)]
        return replace(self, name=f"{self.name}/host{host}", num_ranks=len(ranks),
                       tiers=tuple(tiers),
                       description=f"host {host} of {self.name}: ranks {_ranges(ranks)}")

    def hop_latency_ns(self, h: int) -> float:
        """Access latency of hop class `h`, ns."""
        return self._hop_stat(h)[0]

    def hop_bandwidth_GBps(self, h: int) -> float:
        """Per-rank bandwidth of hop class `h`, GB/s."""
        return self._hop_stat(h)[1]

    def _hop_stat(self, h: int) -> tuple[float, float]:
        if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
            raise TypeError(f"hop class must be an int, got {type(h).__name__}")
        if not 0 <= h < self.num_hop_classes:
            raise ValueError(f"hop class {h} is not in [0, {self.num_hop_classes}) "
                             f"for {self.name!r}")
        if h == 0:
            return self.local_latency_ns, self.local_bandwidth_GBps
        t = self.tiers[h - 1]
        return t.latency_ns, t.bandwidth_GBps

    def hop_class_names(self) -> tuple[str, ...]:
        """Name of each hop class: "local", then the tier names."""
        return self._hop_names

    @cached_property
    def _hop_names(self) -> tuple[str, ...]:
        return ("local",) + tuple(t.name for t in self.tiers)

    @cached_property
    def _plan_cache(self) -> dict:
        """Per-rank expert layouts the planner derives from this fabric (see planner.py)."""
        return {}

    # -- scaled copies -----------------------------------------------------------------
    def with_ranks(self, n: int) -> Topology:
        """The same fabric with `n` ranks: inner tiers keep their groups, the outermost grows."""
        check_int("ranks", n, minimum=1)
        if n == self.num_ranks:
            return self
        fixed = [i for i, t in enumerate(self.tiers) if t.groups is not None]
        if fixed:
            raise ValueError(
                f"ranks={n}: {self.name!r} lists the groups of tiers[{fixed[0]}] "
                f"({self.tiers[fixed[0]].name!r}) for its {self.num_ranks} ranks, so it "
                f"cannot be rescaled; build one for {n} ranks (Topology.from_hosts)")
        outer = replace(self.tiers[-1], ranks_per_group=n)
        return replace(self, num_ranks=n, tiers=self.tiers[:-1] + (outer,))

    def with_workers(self, n: int) -> Topology:
        """The same fabric with `n` workers per rank."""
        check_int("workers", n, minimum=1)
        return self if n == self.workers_per_rank else replace(self, workers_per_rank=n)

    # -- constructors ------------------------------------------------------------------
    @staticmethod
    def preset(name: str, ranks: int | None = None) -> Topology:
        """A shipped fabric: "cm384", "nvl72", "nvl576", "ib-cluster", "cluster" or "host"
        (this machine).

        `ranks` scales it (e.g. `preset("cm384", ranks=64)`: 64 dies, 2 per NPU, 16 per board;
        `preset("cluster", ranks=32)`: 4 hosts of 8).
        """
        if name not in PRESETS:
            raise ValueError(f"preset={name!r} is not one of {', '.join(map(repr, PRESETS))}")
        if name == "host":
            return Topology.host(ranks)
        text = resources.files("ubep.plan").joinpath("presets").joinpath(f"{name}.toml").read_text()
        topo = Topology.from_dict(tomllib.loads(text), where=f"preset {name!r}")
        return topo if ranks is None else topo.with_ranks(ranks)

    @staticmethod
    def from_toml(path: str | os.PathLike) -> Topology:
        """Load a topology file; errors name the file and the bad key."""
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"topology file {str(p)!r} does not exist") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"topology file {str(p)!r} cannot be read: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{p}: not valid TOML: {e}") from None
        return Topology.from_dict(data, where=str(p))

    @staticmethod
    def from_dict(data: dict[str, Any], *, where: str = "topology") -> Topology:
        """Build from the parsed TOML table; errors name `where` and the bad key."""
        if not isinstance(data, dict):
            raise TypeError(f"{where}: expected a table, got {type(data).__name__}")
        cluster_keys = [k for k in ("hosts", "ranks_per_host", "host_groups", "nic_gbps",
                                    "nic_latency_us", "intra_host") if k in data]
        if cluster_keys and "tiers" in data:
            raise ValueError(f"{where}: keys 'tiers' and '{cluster_keys[0]}' exclude each "
                             f"other: a file lists tiers, or describes a cluster (hosts, "
                             f"ranks_per_host, nic_gbps, nic_latency_us, intra_host)")
        if cluster_keys:
            return cluster_from_dict(data, where)
        check_keys(data, _TOP_KEYS, _TOP_REQUIRED, where, prefix="")
        num_ranks = typed(data, "num_ranks", "int", where)
        tiers_raw = data["tiers"]
        if not isinstance(tiers_raw, list) or not tiers_raw:
            raise ValueError(f"{where}: key 'tiers' must be a non-empty array of tables "
                             f"([[tiers]]), got {tiers_raw!r}")
        tiers = []
        for i, t in enumerate(tiers_raw):
            prefix = f"tiers[{i}]."
            if not isinstance(t, dict):
                raise ValueError(f"{where}: key 'tiers[{i}]' must be a table, got {t!r}")
            check_keys(t, _TIER_KEYS, _TIER_REQUIRED, where, prefix=prefix)
            outer = i == len(tiers_raw) - 1
            if "groups" in t:
                if "ranks_per_group" in t:
                    raise ValueError(f"{where}: keys '{prefix}ranks_per_group' and "
                                     f"'{prefix}groups' exclude each other")
                if outer:
                    raise ValueError(f"{where}: key '{prefix}groups' is not allowed on the "
                                     f"outermost tier: it joins every rank (omit the key)")
                groups = typed(t, "groups", "groups", where, prefix)
                tiers.append(Tier.of_groups(
                    typed(t, "name", "str", where, prefix), groups,
                    typed(t, "latency_ns", "float", where, prefix),
                    typed(t, "bandwidth_GBps", "float", where, prefix)))
                continue
            if "ranks_per_group" in t:
                rpg = typed(t, "ranks_per_group", "int", where, prefix)
                if outer and rpg != num_ranks:
                    raise ValueError(
                        f"{where}: key '{prefix}ranks_per_group' = {rpg} must equal "
                        f"num_ranks = {num_ranks}: the outermost tier joins every rank "
                        f"(omit the key)")
            elif outer:
                rpg = num_ranks
            else:
                raise ValueError(f"{where}: key '{prefix}ranks_per_group' is missing "
                                 f"(required for every tier but the outermost)")
            tiers.append(Tier(name=typed(t, "name", "str", where, prefix), ranks_per_group=rpg,
                              latency_ns=typed(t, "latency_ns", "float", where, prefix),
                              bandwidth_GBps=typed(t, "bandwidth_GBps", "float", where, prefix)))
        return Topology(
            name=typed(data, "name", "str", where),
            description=typed(data, "description", "text", where) if "description" in data
            else "",
            num_ranks=num_ranks,
            workers_per_rank=typed(data, "workers_per_rank", "int", where),
            atomic_block_bytes=typed(data, "atomic_block_bytes", "int", where),
            flag_bytes=typed(data, "flag_bytes", "int", where),
            tiers=tuple(tiers),
            local_latency_ns=typed(data, "local_latency_ns", "float", where),
            local_bandwidth_GBps=typed(data, "local_bandwidth_GBps", "float", where),
            staging_rows=typed(data, "staging_rows", "int", where) if "staging_rows" in data
            else 2,
        )

    def to_dict(self) -> dict[str, Any]:
        """The TOML table of this topology (round-trips through `from_dict`)."""
        return {
            "name": self.name, "description": self.description, "num_ranks": self.num_ranks,
            "workers_per_rank": self.workers_per_rank,
            "atomic_block_bytes": self.atomic_block_bytes, "flag_bytes": self.flag_bytes,
            "local_latency_ns": self.local_latency_ns,
            "local_bandwidth_GBps": self.local_bandwidth_GBps,
            "staging_rows": self.staging_rows,
            "tiers": [{"name": t.name, "latency_ns": t.latency_ns,
                       "bandwidth_GBps": t.bandwidth_GBps,
                       **({"ranks_per_group": t.ranks_per_group} if t.groups is None
                          else {"groups": [list(g) for g in t.groups]})}
                      for t in self.tiers],
        }

    @staticmethod
    def cluster(hosts: int | None = None, ranks_per_host: int | Sequence[int] = 8, *,
                nic_gbps: float = 400.0, nic_latency_us: float = NIC_LATENCY_US,
                nics_per_host: int | None = None,
                intra_host: str | os.PathLike | Topology = "host",
                workers_per_rank: int | None = None, name: str = "cluster",
                description: str = "") -> Topology:
        """Hosts joined by a network, ranks numbered host after host.

        Arguments:
            hosts: number of hosts (None: `len(ranks_per_host)`, which must then be a list).
            ranks_per_host: ranks of every host, or a list with each host's count (uneven).
            nic_gbps: one NIC's line rate, Gb/s (400: a CX7 InfiniBand NIC).
            nic_latency_us: one-way latency through the NICs and the switch, us.
            nics_per_host: NICs of one host (None: one per rank, as on DeepEP's H800 nodes);
                a rank's share is `nics_per_host * nic_gbps / ranks` of the largest host.
            intra_host: the inside of one host: "host" (this machine, `Topology.host`), a
                preset name, a TOML path or a one-host `Topology`; rescaled to each host's
                ranks (its tiers, innermost first, up to the one joining the host).
            workers_per_rank: default: the inside of the largest host's.
            name, description: labels (a description is made when empty).
        Returns:
            A `Topology` whose tiers are those inside a host, the host tier (its groups:
            the hosts), then "other host" (latency `nic_latency_us`, per-rank bandwidth from
            the NICs): hop classes 0 (self), same-host classes, then "other host".
        """
        if isinstance(ranks_per_host, (int, np.integer)) and not isinstance(ranks_per_host,
                                                                             bool):
            if hosts is None:
                raise ValueError("hosts is None: give the number of hosts, or ranks_per_host "
                                 "as a list of each host's ranks")
            check_int("hosts", hosts, minimum=1)
            sizes = [check_int("ranks_per_host", ranks_per_host, minimum=1)] * int(hosts)
        elif isinstance(ranks_per_host, Sequence) and not isinstance(ranks_per_host, str):
            sizes = [check_int(f"ranks_per_host[{i}]", n, minimum=1)
                     for i, n in enumerate(ranks_per_host)]
            if not sizes:
                raise ValueError("ranks_per_host=[]: a cluster needs at least one host")
            if hosts is not None and check_int("hosts", hosts, minimum=1) != len(sizes):
                raise ValueError(f"hosts={hosts} but ranks_per_host lists {len(sizes)} hosts")
        else:
            raise TypeError(f"ranks_per_host must be an int or a list of ints, got "
                            f"{type(ranks_per_host).__name__}")
        starts = np.cumsum([0] + sizes)
        groups = [tuple(range(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]
        return build_cluster(groups, nic_gbps=nic_gbps, nic_latency_us=nic_latency_us,
                        nics_per_host=nics_per_host, intra_host=intra_host,
                        workers_per_rank=workers_per_rank, name=name, description=description)

    @staticmethod
    def from_hosts(groups: Sequence[Sequence[int]], *, nic_gbps: float = 400.0,
                   nic_latency_us: float = NIC_LATENCY_US, nics_per_host: int | None = None,
                   intra_host: str | os.PathLike | Topology = "host",
                   workers_per_rank: int | None = None, name: str = "cluster",
                   description: str = "") -> Topology:
        """A cluster whose hosts hold the given ranks (any sizes, any ranks: `groups[h]` is
        host h's ranks, together each rank of `0..P-1` exactly once). The other arguments
        are `Topology.cluster`'s. Inside a host, ranks are taken in ascending order."""
        return build_cluster(normal_groups(groups, "groups"), nic_gbps=nic_gbps,
                        nic_latency_us=nic_latency_us, nics_per_host=nics_per_host,
                        intra_host=intra_host, workers_per_rank=workers_per_rank, name=name,
                        description=description)

    @staticmethod
    def host(ranks: int | None = None) -> Topology:
        """This machine, from /sys NUMA nodes and the cores this process may use.

        Ranks are spread over NUMA nodes in blocks; one tier ("host") when there is one
        node, else "numa" then "host". `ranks=None`: one rank per NUMA node. Workers per
        rank: the usable cores divided among the ranks (at least 1). Latencies and
        bandwidths are nominal (cache-to-cache transfers), not measured here.
        """
        from ubep.plan.hostinfo import discover_host

        return host_topology(discover_host(), ranks)

    @staticmethod
    def resolve(obj: Topology | str | os.PathLike | None, num_ranks: int) -> Topology:
        """The topology `obj` names, with `num_ranks` ranks.

        `obj`: None (this host), a preset name, a TOML path, or a `Topology` (rescaled if
        its rank count differs).
        """
        check_int("num_ranks", num_ranks, minimum=1)
        if obj is None:
            return Topology.host(num_ranks)
        if isinstance(obj, Topology):
            return obj.with_ranks(num_ranks)
        if isinstance(obj, str) and obj in PRESETS:
            return Topology.preset(obj, ranks=num_ranks)
        if isinstance(obj, (str, os.PathLike)):
            p = Path(obj)
            if p.suffix == ".toml" or p.exists():
                return Topology.from_toml(p).with_ranks(num_ranks)
            raise ValueError(f"topology={str(obj)!r} is neither a preset "
                             f"({', '.join(PRESETS)}) nor an existing TOML file")
        raise TypeError(f"topology must be None, a preset name, a TOML path or a Topology, "
                        f"got {type(obj).__name__}")

    def __str__(self) -> str:
        tiers = " > ".join(f"{t.name}/{t.ranks_per_group}" if t.groups is None else
                           f"{t.name}/[{','.join(str(len(g)) for g in t.groups)}]"
                           for t in self.tiers)
        return (f"Topology({self.name!r}, {self.num_ranks} ranks x {self.workers_per_rank} "
                f"workers, tiers {tiers})")


def host_topology(info, ranks: int | None = None) -> Topology:
    """The host topology for a `ubep.plan.hostinfo.HostInfo` (see `Topology.host`)."""
    n = info.num_nodes if ranks is None else check_int("ranks", ranks, minimum=1)
    workers = max(1, info.num_cores // n)
    outer = Tier("host", n, latency_ns=200.0 if info.num_nodes > 1 else 100.0,
                 bandwidth_GBps=10.0)
    tiers: tuple[Tier, ...] = (outer,)
    if info.num_nodes > 1:
        per_node = math.ceil(n / info.num_nodes)
        if per_node < n:
            tiers = (Tier("numa", per_node, latency_ns=100.0, bandwidth_GBps=10.0), outer)
    return Topology(name="host", description=f"this machine: {info.describe()}",
                    num_ranks=n, workers_per_rank=workers, atomic_block_bytes=64,
                    flag_bytes=8, tiers=tiers, local_latency_ns=20.0,
                    local_bandwidth_GBps=20.0)


def normal_groups(groups: object, name: str) -> tuple[tuple[int, ...], ...]:
    """`groups` as a tuple of ascending int tuples: non-empty groups, no rank twice."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(f"{name} must be a non-empty list of groups of ranks, got {groups!r}")
    out, seen = [], set()
    for i, g in enumerate(groups):
        if isinstance(g, (str, bytes)) or not isinstance(g, (Sequence, np.ndarray)) or \
                not len(g):
            raise ValueError(f"{name}[{i}] must be a non-empty list of ranks, got {g!r}")
        ranks = []
        for r in g:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
                raise ValueError(f"{name}[{i}] holds {r!r}: ranks are ints >= 0")
            if int(r) in seen:
                raise ValueError(f"{name}: rank {int(r)} is in two groups (or twice in one); "
                                 f"each rank belongs to exactly one")
            seen.add(int(r))
            ranks.append(int(r))
        out.append(tuple(sorted(ranks)))
    return tuple(out)


def check_cover(groups: Sequence[Sequence[int]], num_ranks: int, name: str) -> None:
    """Every rank of `0..num_ranks-1` in some group (and no other rank)."""
    have = {r for g in groups for r in g}
    missing = sorted(set(range(num_ranks)) - have)
    extra = sorted(have - set(range(num_ranks)))
    if missing or extra:
        what = (f"ranks {_ranges(missing)} are in no group" if missing
                else f"ranks {_ranges(extra)} are not in 0..{num_ranks - 1}")
        raise ValueError(f"'{name}': {what} (the groups must hold each rank of "
                         f"0..{num_ranks - 1} exactly once)")


def _ranges(ranks: Sequence[int]) -> str:
    """`[0, 1, 2, 5, 7, 8]` -> "0-2, 5, 7-8"."""
    out, rs = [], sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(out)


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as compact ranges: `[0, 1, 2, 5]` -> "0-2, 5" (for tables and pictures)."""
    return _ranges(ranks)


# -- groups and validation -------------------------------------------------------------------------
def _check_index(name: str, value: object, size: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < size:
        raise ValueError(f"{name}={value} is not in [0, {size})")
    return int(value)


def check_positive(name: str, value: object) -> float:
    ok = (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
          and math.isfinite(value) and value > 0)
    if not ok:
        raise ValueError(f"{name}={value!r} must be a positive number")
    return float(value)


def check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def check_keys(table: dict, allowed: dict[str, str], required: tuple[str, ...], where: str,
                prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key '{prefix}{key}' "
                             f"(allowed: {', '.join(allowed)})")
    for key in required:
        if key not in table:
            raise ValueError(f"{where}: key '{prefix}{key}' is missing")


def typed(table: dict, key: str, kind: str, where: str, prefix: str = "") -> Any:
    value = table[key]
    bad = None
    if kind == "str":
        bad = None if isinstance(value, str) and value else "a non-empty string"
    elif kind == "text":
        bad = None if isinstance(value, str) else "a string"
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        bad = None if ok else "a positive integer"
    elif kind == "groups":
        ok = (isinstance(value, list) and value and all(
            isinstance(g, list) and g and all(isinstance(r, int) and not isinstance(r, bool)
                                               and r >= 0 for r in g) for g in value))
        bad = None if ok else "a non-empty array of non-empty arrays of ranks (ints >= 0)"
        if ok:
            try:
                value = normal_groups(value, f"'{prefix}{key}'")
            except ValueError as e:
                raise ValueError(f"{where}: key {e}") from None
    elif kind == "float":
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value) and value > 0)
        bad = None if ok else "a positive number"
        value = float(value) if ok else value
    if bad:
        raise ValueError(f"{where}: key '{prefix}{key}' must be {bad}, got {value!r}")
    return value


def _check_topology(t: Topology, where: str) -> None:
    """The structural rules of a topology (types are checked by the TOML loader)."""
    check_int("num_ranks", t.num_ranks, minimum=1)
    check_int("workers_per_rank", t.workers_per_rank, minimum=1)
    check_int("atomic_block_bytes", t.atomic_block_bytes, minimum=8)
    check_int("flag_bytes", t.flag_bytes, minimum=1)
    check_int("staging_rows", t.staging_rows, minimum=1)
    if t.flag_bytes >= t.atomic_block_bytes:
        raise ValueError(f"{where}: flag_bytes={t.flag_bytes} must be < atomic_block_bytes="
                         f"{t.atomic_block_bytes} (a block must carry payload)")
    if not t.tiers:
        raise ValueError(f"{where}: tiers must hold at least one tier")
    for i, tier in enumerate(t.tiers):
        if not isinstance(tier, Tier):
            raise TypeError(f"{where}: tiers[{i}] must be a Tier, got {type(tier).__name__}")
        if tier.latency_ns <= 0 or tier.bandwidth_GBps <= 0:
            raise ValueError(f"{where}: tiers[{i}] ({tier.name!r}) needs positive latency_ns "
                             f"and bandwidth_GBps")
        if tier.name == NETWORK_TIER and i != len(t.tiers) - 1:
            raise ValueError(f"{where}: tiers[{i}] is named {NETWORK_TIER!r}, the network "
                             f"between hosts; only the outermost tier may be")
        if tier.groups is not None:
            if i == len(t.tiers) - 1:
                raise ValueError(f"{where}: tiers[{i}] ({tier.name!r}) lists groups; the "
                                 f"outermost tier joins every rank (no groups)")
            try:
                check_cover(tier.groups, t.num_ranks, f"tiers[{i}].groups")
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            largest = max(len(g) for g in tier.groups)
            if tier.ranks_per_group != largest:
                raise ValueError(f"{where}: tiers[{i}].ranks_per_group={tier.ranks_per_group} "
                                 f"must be its largest group's size {largest} "
                                 f"(Tier.of_groups fills it)")
    for i, tier in enumerate(t.tiers):
        if i < len(t.tiers) - 1:
            nxt = t.tiers[i + 1].ranks_per_group
            if tier.ranks_per_group < 1:
                raise ValueError(f"{where}: tiers[{i}].ranks_per_group="
                                 f"{tier.ranks_per_group} must be >= 1")
            if i < len(t.tiers) - 2:
                inner = tier.group_ids(t.num_ranks)
                outer = t.tiers[i + 1].group_ids(t.num_ranks)
                pairs = np.unique(np.stack([inner, outer]), axis=1)
                split = np.flatnonzero(np.bincount(pairs[0]) > 1)
                if split.size and tier.groups is None and t.tiers[i + 1].groups is None:
                    raise ValueError(
                        f"{where}: tiers[{i + 1}].ranks_per_group={nxt} must be a multiple "
                        f"of tiers[{i}].ranks_per_group={tier.ranks_per_group} (groups nest)")
                if split.size:
                    g = int(split[0])
                    raise ValueError(
                        f"{where}: group {g} of tiers[{i}] ({tier.name!r}: ranks "
                        f"{_ranges(np.flatnonzero(inner == g).tolist())}) is split between "
                        f"groups of tiers[{i + 1}] ({t.tiers[i + 1].name!r}); groups nest")
    if t.tiers[-1].ranks_per_group != t.num_ranks:
        raise ValueError(f"{where}: the outermost tier {t.tiers[-1].name!r} has ranks_per_group="
                         f"{t.tiers[-1].ranks_per_group}; it must join all {t.num_ranks} ranks")
    if t.local_latency_ns <= 0 or t.local_bandwidth_GBps <= 0:
        raise ValueError(f"{where}: local_latency_ns and local_bandwidth_GBps must be positive")


# -- clusters: hosts joined by a network, built around the inside of one host -----------------
# `Topology.cluster`, `Topology.from_hosts` and cluster files (`hosts`, `ranks_per_host`,
# `nic_gbps`, `nic_latency_us`, `[intra_host]`): the tiers inside a host are repeated on every
# host's ranks, the host tier's groups are the hosts, and the outermost tier, "other host"
# (`NETWORK_TIER`), is the network (one rank's share of its host's NICs).

#: a cluster file's keys (see `Topology.cluster`)
_CLUSTER_KEYS = {
    "name": "str", "description": "str", "hosts": "int", "ranks_per_host": "int or array",
    "host_groups": "groups", "nic_gbps": "float", "nic_latency_us": "float",
    "nics_per_host": "int", "workers_per_rank": "int", "intra_host": "str or table"}
_CLUSTER_REQUIRED = ("name", "nic_gbps", "nic_latency_us")


def build_cluster(groups: Sequence[Sequence[int]], *, nic_gbps: float, nic_latency_us: float,
                  intra_host, name: str, description: str, nics_per_host: int | None = None,
                  workers_per_rank: int | None = None) -> Topology:
    """`Topology.cluster` / `from_hosts` for hosts given as rank groups."""
    groups = normal_groups(groups, "groups")
    num_ranks = sum(len(g) for g in groups)
    check_cover(groups, num_ranks, "groups")
    nic_gbps = check_positive("nic_gbps", nic_gbps)
    nic_latency_us = check_positive("nic_latency_us", nic_latency_us)
    largest = max(len(g) for g in groups)
    try:
        base = Topology.resolve(intra_host, largest)
    except (TypeError, ValueError) as e:
        raise type(e)(f"intra_host={intra_host!r}: {e}") from None
    if base.network_hop_class is not None:
        raise ValueError(f"intra_host={base.name!r} spans several hosts (it has an "
                         f"{NETWORK_TIER!r} tier): give the inside of one host")
    per_host = [base.with_ranks(len(g)) for g in groups]
    tiers = []
    for i, t in enumerate(base.tiers[:-1]):    # tiers inside a host, per host's groups
        tier_groups = [tuple(g[k] for k in local)
                       for g, inside in zip(groups, per_host) for local in inside.tier_groups(i)]
        tiers.append(Tier.of_groups(t.name, tier_groups, t.latency_ns, t.bandwidth_GBps))
    host = base.tiers[-1]
    tiers.append(Tier.of_groups(host.name, groups, host.latency_ns, host.bandwidth_GBps))
    nic_GBps = nic_gbps / 8
    if nics_per_host is not None:
        nic_GBps *= check_int("nics_per_host", nics_per_host, minimum=1) / largest
    tiers.append(Tier(NETWORK_TIER, num_ranks, nic_latency_us * 1e3, nic_GBps))
    if not description:
        sizes = {len(g) for g in groups}
        shape = (f"{len(groups)} hosts x {largest} ranks" if len(sizes) == 1 else
                 f"{len(groups)} hosts of {'/'.join(str(len(g)) for g in groups)} ranks")
        nics = "one per rank" if nics_per_host is None else f"{nics_per_host} per host"
        description = (f"{shape}, {nic_gbps:g} Gb/s NICs ({nics}, {nic_latency_us:g} us); "
                       f"inside a host: {base.name}")
    return Topology(name=name, description=description, num_ranks=num_ranks,
                    workers_per_rank=(base.workers_per_rank if workers_per_rank is None else
                                      check_int("workers_per_rank", workers_per_rank,
                                                 minimum=1)),
                    atomic_block_bytes=base.atomic_block_bytes, flag_bytes=base.flag_bytes,
                    tiers=tuple(tiers), local_latency_ns=base.local_latency_ns,
                    local_bandwidth_GBps=base.local_bandwidth_GBps,
                    staging_rows=base.staging_rows)


def cluster_from_dict(data: dict, where: str) -> Topology:
    """A cluster file (`hosts`, `ranks_per_host`, `nic_gbps`, ... see `Topology.cluster`)."""
    check_keys(data, _CLUSTER_KEYS, _CLUSTER_REQUIRED, where, prefix="")
    kw: dict[str, Any] = {}
    if "host_groups" in data:
        for other in ("hosts", "ranks_per_host"):
            if other in data:
                raise ValueError(f"{where}: keys 'host_groups' and '{other}' exclude each "
                                 f"other (host_groups lists every host's ranks)")
        groups = typed(data, "host_groups", "groups", where)
        try:
            check_cover(groups, sum(len(g) for g in groups), "host_groups")
        except ValueError as e:
            raise ValueError(f"{where}: key {e}") from None
    else:
        if "ranks_per_host" not in data:
            raise ValueError(f"{where}: key 'ranks_per_host' is missing (or give "
                             f"'host_groups')")
        rph = data["ranks_per_host"]
        if isinstance(rph, list):
            if not rph or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                  for n in rph):
                raise ValueError(f"{where}: key 'ranks_per_host' must be a positive integer "
                                 f"or a non-empty array of them, got {rph!r}")
            if "hosts" in data and typed(data, "hosts", "int", where) != len(rph):
                raise ValueError(f"{where}: key 'hosts' = {data['hosts']} must equal the "
                                 f"{len(rph)} entries of 'ranks_per_host'")
            sizes = rph
        else:
            n = typed(data, "ranks_per_host", "int", where)
            if "hosts" not in data:
                raise ValueError(f"{where}: key 'hosts' is missing (required when "
                                 f"'ranks_per_host' is one number)")
            sizes = [n] * typed(data, "hosts", "int", where)
        starts = np.cumsum([0] + list(sizes))
        groups = [list(range(int(a), int(b))) for a, b in zip(starts[:-1], starts[1:])]
    intra: Any = "host"
    if "intra_host" in data:
        raw = data["intra_host"]
        if isinstance(raw, str) and raw:
            intra = raw
        elif isinstance(raw, dict):
            table = dict(raw)
            table.setdefault("num_ranks", max(len(g) for g in groups))
            intra = Topology.from_dict(table, where=f"{where} [intra_host]")
        else:
            raise ValueError(f"{where}: key 'intra_host' must be a preset name, a TOML path "
                             f"or a table ([intra_host]) describing one host, got {raw!r}")
    for key in ("nics_per_host", "workers_per_rank"):
        if key in data:
            kw[key] = typed(data, key, "int", where)
    return build_cluster(groups, nic_gbps=typed(data, "nic_gbps", "float", where),
                    nic_latency_us=typed(data, "nic_latency_us", "float", where),
                    intra_host=intra, name=typed(data, "name", "str", where),
                    description=(typed(data, "description", "text", where)
                                 if "description" in data else ""), **kw)
