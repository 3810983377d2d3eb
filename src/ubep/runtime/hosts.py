"""Which ranks of a group share a host's shared memory: the hosts `auto` and `hybrid` see.

A host here is a shared-memory domain: ranks that map the same /dev/shm (same kernel boot
id, same mount; `segments.host_memory_key`), whatever their hostnames.
"""

from __future__ import annotations

from ubep.runtime import bootstrap
from ubep.runtime.shm.segments import host_memory_key


def hosts_of_keys(keys: list) -> tuple[tuple[int, ...], ...]:
    """Ranks grouped by equal key, ranks ascending, groups ordered by first rank (a rank
    with no key, None, is a host of its own)."""
    groups: dict = {}
    for r, k in enumerate(keys):
        groups.setdefault(k if k is not None else ("none", r), []).append(r)
    return tuple(sorted(tuple(g) for g in groups.values()))


def discover_hosts(group, *, rank: int, world: int,
                   timeout_s: float) -> tuple[tuple[int, ...], ...]:
    """The group ranks of each host. Collective: every rank of `group` must call it."""
    keys = bootstrap.exchange(host_memory_key(), group, rank=rank, world=world,
                              timeout_s=timeout_s, phase="Buffer()/hosts")
    return hosts_of_keys(keys)
