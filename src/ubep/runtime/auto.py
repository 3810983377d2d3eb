"""`Buffer(backend="auto")`: shared memory when the group allows it, torch.distributed otherwise.

The shm backend needs every rank of the group to map the same shared memory: the same
kernel (boot id) and the same /dev/shm mount (device and inode of the directory; containers
on one host may or may not share it, and a hostname says neither). It also needs room there
for every rank's segment. When both hold, shm is the fastest path on a host (see
docs/results.md); otherwise the torch backend works over any process group. All ranks agree
on the answer because they decide from the same gathered facts.

On shm, when the caller left `mode` and `direct` to it, auto runs `direct="owned"`: one copy
per row with results the caller owns (`runtime/shm/direct/`; docs/design.md §2.5; its
time beside the paper's two-copy path's is in docs/results.md). It needs room for the
direct areas, else the two-copy path runs.
"""

from __future__ import annotations

import dataclasses

from ubep.options import BufferConfig
from ubep.runtime.bootstrap import exchange
from ubep.runtime.hosts import hosts_of_keys
from ubep.runtime.shm.segments import SHM_DIR, host_memory_key

__all__ = ["choose_backend", "host_memory_key", "shm_bytes_needed", "SHM_DIR"]


def shm_bytes_needed(config: BufferConfig, workers: int) -> int:
    """Bytes one rank's shm segment takes for `config` with `workers` worker threads."""
    from ubep.plan.blocks import BlockFormat
    from ubep.runtime.shm.region import segment_layouts

    return segment_layouts(config, max_workers=workers,
                           fmt=BlockFormat(config.sync, config.block_bytes))[2]


def _shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    from ubep.runtime.shm.segments import shm_free_bytes

    try:
        return shm_free_bytes(shm_dir)
    except OSError:
        return 0


def choose_backend(config: BufferConfig, group, *,
                   owned: bool = False) -> tuple[str, str, bool | str, tuple]:
    """("shm" | "hybrid" | "torch", why, direct, hosts) for `config` on `group`. Collective:
    every rank must call it.

    shm when every rank maps the same /dev/shm and it has room for all the ranks' segments
    (with a 10% margin); hybrid when the ranks span several shared-memory domains (hosts),
    each with room for its ranks' part; torch otherwise. With `owned` (the caller chose
    neither mode nor direct), shm runs `direct="owned"` if its segments fit too; else
    `direct` is `config.direct`. `hosts`: the group ranks of each domain. The same answer on
    every rank.
    """
    from ubep.runtime.shm.backend import default_workers

    c = config
    workers = c.workers or default_workers(c.world_size)
    mine = (host_memory_key(), workers, _shm_free_bytes())
    facts = exchange(mine, group, rank=c.rank, world=c.world_size, timeout_s=c.timeout_s,
                     phase="Buffer()/auto")
    keys = {f[0] for f in facts}
    hosts = hosts_of_keys([f[0] for f in facts])
    if None in keys:
        return "torch", "a rank has no /dev/shm", c.direct, hosts
    if len(keys) > 1:
        return _across_hosts(c, facts, hosts, workers) + (hosts,)
    workers = max(f[1] for f in facts)
    need = c.world_size * shm_bytes_needed(c, workers)
    free = min(f[2] for f in facts)
    room = f"({{:.1f}} of {free / 2**20:.0f} MiB free)"
    if owned:
        need_owned = c.world_size * shm_bytes_needed(
            dataclasses.replace(c, direct="owned"), workers)
        if need_owned * 1.1 <= free:
            return "shm", (f"every rank on this host; /dev/shm has room "
                           f"{room.format(need_owned / 2**20)}; direct='owned': one copy per "
                           f"row, results yours"), "owned", hosts
    if need * 1.1 > free:
        return "torch", (f"/dev/shm has {free / 2**20:.0f} MiB free, the shm backend needs "
                         f"{need / 2**20:.0f} MiB for {c.world_size} ranks"), c.direct, hosts
    why = f"every rank on this host; /dev/shm has room {room.format(need / 2**20)}"
    if owned:
        why += (f"; the two-copy path: direct='owned' would need "
                f"{need_owned / 2**20:.0f} MiB")
    return "shm", why, c.direct, hosts


def _across_hosts(c: BufferConfig, facts: list, hosts: tuple,
                  workers: int) -> tuple[str, str, bool]:
    """hybrid if every host's /dev/shm has room for its ranks' shared-memory part, else
    torch; (backend, why, direct)."""
    from ubep.plan.hosts import HostLayout

    lay = HostLayout.of(hosts, c.num_experts)
    span = (f"the group's {c.world_size} ranks span {len(hosts)} shared-memory domains "
            f"(hosts {[list(h) for h in hosts]})")
    for h, ranks in enumerate(lay.hosts):
        part = dataclasses.replace(
            c, world_size=len(ranks), num_experts=lay.host_experts(h), direct="owned",
            max_tokens_per_rank=max(lay.max_virtual_tokens_on(h, c.max_tokens_per_rank),
                                    c.max_tokens_per_rank))
        need = len(ranks) * shm_bytes_needed(part, workers)
        free = min(facts[r][2] for r in ranks)
        if need * 1.1 > free:
            return "torch", (f"{span}; host {h}'s /dev/shm has {free / 2**20:.0f} MiB free, "
                             f"the hybrid backend needs {need / 2**20:.0f} MiB there"), c.direct
    return "hybrid", (f"{span}; hybrid: shared memory inside each host, torch.distributed "
                      f"between them, each token once per host"), False
