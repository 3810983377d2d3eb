"""Clusters: hosts joined by a network, built around the inside of one host.

`Topology.cluster`, `Topology.from_hosts` and cluster files (`hosts`, `ranks_per_host`,
`nic_gbps`, `nic_latency_us`, `[intra_host]`) come here: the tiers inside a host are
repeated on every host's ranks, the host tier's groups are the hosts, and the outermost
tier, "other host" (`NETWORK_TIER`), is the network (one rank's share of its host's NICs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ubep.plan.topology import (
    NETWORK_TIER,
    Tier,
    Topology,
    _check_cover,
    _check_int,
    _check_keys,
    _check_positive,
    _normal_groups,
    _typed,
)

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
    groups = _normal_groups(groups, "groups")
    num_ranks = sum(len(g) for g in groups)
    _check_cover(groups, num_ranks, "groups")
    nic_gbps = _check_positive("nic_gbps", nic_gbps)
    nic_latency_us = _check_positive("nic_latency_us", nic_latency_us)
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
        nic_GBps *= _check_int("nics_per_host", nics_per_host, minimum=1) / largest
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
                                      _check_int("workers_per_rank", workers_per_rank,
                                                 minimum=1)),
                    atomic_block_bytes=base.atomic_block_bytes, flag_bytes=base.flag_bytes,
                    tiers=tuple(tiers), local_latency_ns=base.local_latency_ns,
                    local_bandwidth_GBps=base.local_bandwidth_GBps,
                    staging_rows=base.staging_rows)


def cluster_from_dict(data: dict, where: str) -> Topology:
    """A cluster file (`hosts`, `ranks_per_host`, `nic_gbps`, ... see `Topology.cluster`)."""
    _check_keys(data, _CLUSTER_KEYS, _CLUSTER_REQUIRED, where, prefix="")
    kw: dict[str, Any] = {}
    if "host_groups" in data:
        for other in ("hosts", "ranks_per_host"):
            if other in data:
                raise ValueError(f"{where}: keys 'host_groups' and '{other}' exclude each "
                                 f"other (host_groups lists every host's ranks)")
        groups = _typed(data, "host_groups", "groups", where)
        try:
            _check_cover(groups, sum(len(g) for g in groups), "host_groups")
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
            if "hosts" in data and _typed(data, "hosts", "int", where) != len(rph):
                raise ValueError(f"{where}: key 'hosts' = {data['hosts']} must equal the "
                                 f"{len(rph)} entries of 'ranks_per_host'")
            sizes = rph
        else:
            n = _typed(data, "ranks_per_host", "int", where)
            if "hosts" not in data:
                raise ValueError(f"{where}: key 'hosts' is missing (required when "
                                 f"'ranks_per_host' is one number)")
            sizes = [n] * _typed(data, "hosts", "int", where)
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
            kw[key] = _typed(data, key, "int", where)
    return build_cluster(groups, nic_gbps=_typed(data, "nic_gbps", "float", where),
                    nic_latency_us=_typed(data, "nic_latency_us", "float", where),
                    intra_host=intra, name=_typed(data, "name", "str", where),
                    description=(_typed(data, "description", "text", where)
                                 if "description" in data else ""), **kw)
