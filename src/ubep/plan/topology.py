"""The fabric model every planner, executor and the simulator share: ranks, tiers, hop classes.

A topology is a tree of tiers, innermost first. Tier i groups ranks in blocks of
`ranks_per_group` consecutive ranks (rank r is in group `r // ranks_per_group`); the
outermost tier joins every rank. Two distinct ranks are in hop class `i + 1` for the
innermost tier i whose group holds both; hop class 0 is the rank itself (a local store).
Each hop class has a latency and a per-rank bandwidth.

Files are TOML (see `plan/presets/*.toml`); `Topology.preset(name, ranks=n)` scales a
preset to n ranks laid out as on the real machine (the outermost tier grows or shrinks).
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field, replace
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

PRESETS = ("cm384", "nvl72", "nvl576", "ib-cluster", "host")

_TOP_KEYS = {
    "name": "str", "description": "str", "num_ranks": "int", "workers_per_rank": "int",
    "atomic_block_bytes": "int", "flag_bytes": "int", "local_latency_ns": "float",
    "local_bandwidth_GBps": "float", "tiers": "list", "staging_rows": "int",
}
_TOP_REQUIRED = ("name", "num_ranks", "workers_per_rank", "atomic_block_bytes", "flag_bytes",
                 "local_latency_ns", "local_bandwidth_GBps", "tiers")
_TIER_KEYS = {"name": "str", "ranks_per_group": "int", "latency_ns": "float",
              "bandwidth_GBps": "float"}
_TIER_REQUIRED = ("name", "latency_ns", "bandwidth_GBps")


@dataclass(frozen=True)
class Tier:
    """One level of the fabric: blocks of `ranks_per_group` ranks that reach each other here.

    Attributes:
        name: e.g. "npu", "board", "pod".
        ranks_per_group: ranks in one group of this tier (the outermost tier: all ranks).
        latency_ns: one store's access latency between two ranks whose nearest common
            group is of this tier.
        bandwidth_GBps: per-rank bandwidth toward such ranks, GB/s (1e9 bytes per second).
    """

    name: str
    ranks_per_group: int
    latency_ns: float
    bandwidth_GBps: float


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
        for i, tier in enumerate(self.tiers):
            if src // tier.ranks_per_group == dst // tier.ranks_per_group:
                return i + 1
        return len(self.tiers)  # unreachable: the outermost tier joins every rank

    def hop_matrix(self) -> np.ndarray:
        """`[num_ranks, num_ranks]` int64, read-only: the hop class of every (src, dst) pair."""
        return self._hop_matrix

    @cached_property
    def _hop_matrix(self) -> np.ndarray:
        ranks = np.arange(self.num_ranks)
        hops = np.full((self.num_ranks, self.num_ranks), len(self.tiers), dtype=np.int64)
        for i in range(len(self.tiers) - 2, -1, -1):  # inner tiers override outer ones
            group = ranks // self.tiers[i].ranks_per_group
            hops[group[:, None] == group[None, :]] = i + 1
        np.fill_diagonal(hops, 0)
        hops.setflags(write=False)
        return hops

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
        _check_int("ranks", n, minimum=1)
        if n == self.num_ranks:
            return self
        outer = replace(self.tiers[-1], ranks_per_group=n)
        return replace(self, num_ranks=n, tiers=self.tiers[:-1] + (outer,))

    def with_workers(self, n: int) -> Topology:
        """The same fabric with `n` workers per rank."""
        _check_int("workers", n, minimum=1)
        return self if n == self.workers_per_rank else replace(self, workers_per_rank=n)

    # -- constructors ------------------------------------------------------------------
    @staticmethod
    def preset(name: str, ranks: int | None = None) -> Topology:
        """A shipped fabric: "cm384", "nvl72", "nvl576", "ib-cluster" or "host" (this machine).

        `ranks` scales it (e.g. `preset("cm384", ranks=64)`: 64 dies, 2 per NPU, 16 per board).
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
        _check_keys(data, _TOP_KEYS, _TOP_REQUIRED, where, prefix="")
        num_ranks = _typed(data, "num_ranks", "int", where)
        tiers_raw = data["tiers"]
        if not isinstance(tiers_raw, list) or not tiers_raw:
            raise ValueError(f"{where}: key 'tiers' must be a non-empty array of tables "
                             f"([[tiers]]), got {tiers_raw!r}")
        tiers = []
        for i, t in enumerate(tiers_raw):
            prefix = f"tiers[{i}]."
            if not isinstance(t, dict):
                raise ValueError(f"{where}: key 'tiers[{i}]' must be a table, got {t!r}")
            _check_keys(t, _TIER_KEYS, _TIER_REQUIRED, where, prefix=prefix)
            outer = i == len(tiers_raw) - 1
            if "ranks_per_group" in t:
                rpg = _typed(t, "ranks_per_group", "int", where, prefix)
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
            tiers.append(Tier(name=_typed(t, "name", "str", where, prefix), ranks_per_group=rpg,
                              latency_ns=_typed(t, "latency_ns", "float", where, prefix),
                              bandwidth_GBps=_typed(t, "bandwidth_GBps", "float", where, prefix)))
        return Topology(
            name=_typed(data, "name", "str", where),
            description=_typed(data, "description", "text", where) if "description" in data
            else "",
            num_ranks=num_ranks,
            workers_per_rank=_typed(data, "workers_per_rank", "int", where),
            atomic_block_bytes=_typed(data, "atomic_block_bytes", "int", where),
            flag_bytes=_typed(data, "flag_bytes", "int", where),
            tiers=tuple(tiers),
            local_latency_ns=_typed(data, "local_latency_ns", "float", where),
            local_bandwidth_GBps=_typed(data, "local_bandwidth_GBps", "float", where),
            staging_rows=_typed(data, "staging_rows", "int", where) if "staging_rows" in data
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
            "tiers": [{"name": t.name, "ranks_per_group": t.ranks_per_group,
                       "latency_ns": t.latency_ns, "bandwidth_GBps": t.bandwidth_GBps}
                      for t in self.tiers],
        }

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
        _check_int("num_ranks", num_ranks, minimum=1)
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
        tiers = " > ".join(f"{t.name}/{t.ranks_per_group}" for t in self.tiers)
        return (f"Topology({self.name!r}, {self.num_ranks} ranks x {self.workers_per_rank} "
                f"workers, tiers {tiers})")


def host_topology(info, ranks: int | None = None) -> Topology:
    """The host topology for a `ubep.plan.hostinfo.HostInfo` (see `Topology.host`)."""
    n = info.num_nodes if ranks is None else _check_int("ranks", ranks, minimum=1)
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


# -- validation -------------------------------------------------------------------------
def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return int(value)


def _check_keys(table: dict, allowed: dict[str, str], required: tuple[str, ...], where: str,
                prefix: str) -> None:
    for key in table:
        if key not in allowed:
            raise ValueError(f"{where}: unknown key '{prefix}{key}' "
                             f"(allowed: {', '.join(allowed)})")
    for key in required:
        if key not in table:
            raise ValueError(f"{where}: key '{prefix}{key}' is missing")


def _typed(table: dict, key: str, kind: str, where: str, prefix: str = "") -> Any:
    value = table[key]
    bad = None
    if kind == "str":
        bad = None if isinstance(value, str) and value else "a non-empty string"
    elif kind == "text":
        bad = None if isinstance(value, str) else "a string"
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        bad = None if ok else "a positive integer"
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
    _check_int("num_ranks", t.num_ranks, minimum=1)
    _check_int("workers_per_rank", t.workers_per_rank, minimum=1)
    _check_int("atomic_block_bytes", t.atomic_block_bytes, minimum=8)
    _check_int("flag_bytes", t.flag_bytes, minimum=1)
    _check_int("staging_rows", t.staging_rows, minimum=1)
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
        if i < len(t.tiers) - 1:
            nxt = t.tiers[i + 1].ranks_per_group
            if tier.ranks_per_group < 1:
                raise ValueError(f"{where}: tiers[{i}].ranks_per_group="
                                 f"{tier.ranks_per_group} must be >= 1")
            if i < len(t.tiers) - 2 and nxt % tier.ranks_per_group:
                raise ValueError(
                    f"{where}: tiers[{i + 1}].ranks_per_group={nxt} must be a multiple of "
                    f"tiers[{i}].ranks_per_group={tier.ranks_per_group} (groups nest)")
    if t.tiers[-1].ranks_per_group != t.num_ranks:
        raise ValueError(f"{where}: the outermost tier {t.tiers[-1].name!r} has ranks_per_group="
                         f"{t.tiers[-1].ranks_per_group}; it must join all {t.num_ranks} ranks")
    if t.local_latency_ns <= 0 or t.local_bandwidth_GBps <= 0:
        raise ValueError(f"{where}: local_latency_ns and local_bandwidth_GBps must be positive")
